from megatron.core.models.bert.bert_model import BertModel

__all__ = ["BertModel"]
