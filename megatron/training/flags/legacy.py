"""Flags of Megatron's legacy task families: vision (ViT, DINO, inpainting) and the ICT/REALM
biencoder retriever. They parse so that old scripts keep their spelling; flags/policy.py
says what happens when one is given."""

from typing import List, Optional

from megatron.training.flags.spec import flag, flag_group, off_switch, switch


@flag_group("biencoder")
class BiencoderFlags:
    ict_head_size: Optional[int] = flag(None, "Size of the ICT/REALM retrieval head.")
    biencoder_projection_dim: int = flag(0, "Projection size of the biencoder (0: none).")
    biencoder_shared_query_context_model: bool = switch(
        "One model encodes both queries and contexts."
    )
    ict_load: Optional[str] = flag(None, "Directory of the ICT checkpoint to load.")
    bert_load: Optional[str] = flag(None, "Directory of the BERT checkpoint to start from.")
    titles_data_path: Optional[str] = flag(None, "Dataset prefix of the document titles.")
    query_in_block_prob: float = flag(0.1, "Probability that the query stays in its block.")
    use_one_sent_docs: bool = switch("Keep one-sentence documents.")
    evidence_data_path: Optional[str] = flag(None, "Evidence dataset (a TSV file).")
    retriever_report_topk_accuracies: List[int] = flag(
        [], "Top-k retrieval accuracies to report.", nargs="+"
    )
    retriever_score_scaling: bool = switch("Scale retrieval scores by 1/sqrt(hidden size).")
    block_data_path: Optional[str] = flag(None, "Where the block data is written or read.")
    embedding_path: Optional[str] = flag(None, "Where the block embeddings are written or read.")
    indexer_batch_size: int = flag(128, "Batch size of the indexing job.")
    indexer_log_interval: int = flag(1000, "Batches between indexing progress reports.")


@flag_group("vision")
class VisionFlags:
    num_classes: int = flag(1000, "Number of classes of the vision classification task.")
    img_h: int = flag(224, "Image height.")
    img_w: int = flag(224, "Image width.")
    num_channels: int = flag(3, "Image channels.")
    patch_dim: int = flag(16, "Patch size.")
    classes_fraction: float = flag(1.0, "Fraction of the classes used for training.")
    data_per_class_fraction: float = flag(1.0, "Fraction of the images per class used.")
    data_sharding: bool = off_switch(
        "Do not shard the data over data-parallel ranks.",
        options="--no-data-sharding",
        honoured_at="data_samplers.build_pretraining_data_loader",
    )
    head_lr_mult: float = flag(1.0, "Learning-rate multiplier of the classification head.")
    vision_pretraining: bool = switch("Run vision pretraining.")
    vision_pretraining_type: str = flag(
        "classify", "Vision pretraining objective.", choices=["classify", "inpaint", "dino"]
    )
    vision_backbone_type: str = flag("vit", "Vision backbone.", choices=["vit", "mit", "swin"])
    swin_backbone_type: str = flag("tiny", "Swin backbone size.", choices=["tiny", "base", "h3"])
    mask_type: str = flag("random", "Inpainting mask type.", choices=["random", "row"])
    mask_factor: float = flag(1.0, "Inpainting mask size factor.")
    iter_per_epoch: int = flag(1250, "Iterations per epoch (vision schedules).")
    dino_local_img_size: int = flag(96, "DINO: size of the local crops.")
    dino_local_crops_number: int = flag(10, "DINO: local crops per image.")
    dino_head_hidden_size: int = flag(2048, "DINO: hidden size of the projection head.")
    dino_bottleneck_size: int = flag(256, "DINO: bottleneck size of the projection head.")
    dino_freeze_last_layer: float = flag(1, "DINO: epochs during which the last layer is frozen.")
    dino_norm_last_layer: bool = switch("DINO: weight-normalize the last layer.")
    dino_warmup_teacher_temp: float = flag(0.04, "DINO: initial teacher temperature.")
    dino_teacher_temp: float = flag(0.07, "DINO: final teacher temperature.")
    dino_warmup_teacher_temp_epochs: int = flag(30, "DINO: epochs of teacher-temperature warm-up.")
