"""DeepSeek-V3 (Hugging Face) <-> our torch-format checkpoints through tools/checkpoint/convert.py.

A tiny random ``DeepseekV3ForCausalLM``: 2 layers, the first dense (``first_k_dense_replace``
1), then MoE with 4 experts top-2 and a shared expert, the sigmoid router with its expert bias,
2 groups of which 1 is chosen, q-LoRA, interleaved RoPE rows (DeepSeek's layout), and an MTP
layer added to its files as DeepSeek's hold one (``model.layers.2.*``).

- HF -> ours at TP2 x PP2 x EP2 -> HF, and HF -> ours at TP1 x PP2 x EP4 -> HF: the same key set
  and bit-identical tensors (torch.equal), which transformers' ``from_pretrained`` loads with no
  missing or unexpected key.
- ours at TP2 x PP2 x EP2 -> ours at TP1 x PP1 x EP1 -> HF: still bit-identical; that one-file
  checkpoint, built into our GPTModel from its saved args (the trainer's config path, the MTP
  depth included), loads strictly and gives transformers' logits within 1e-4 in fp32 (measured
  6e-8; transformers has no MTP, so the MTP weights are proven by the round trips only).
- A Megatron-born dense MLA checkpoint (YaRN, q-LoRA) written by the saver alone gives its
  logits in transformers within 1e-4 (measured 1.5e-7).
- A config the converter cannot map fails in one line naming the field.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from megatron.checkpointing.torch_format import TorchCheckpointReader, TorchCheckpointWriter
from megatron.core.dist_checkpointing.megatron_layout import with_extra_state, without_extra_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.transformer.multi_token_prediction import mtp_layer_spec
from megatron.training.configs import core_transformer_config_from_args
from tests.unit_tests.tiny_configs import tiny_args
from tests.unit_tests.tools.checkpoint.test_checkpoint_conversion_hf import (
    VOCAB,
    ConversionError,
    assert_same_tensors,
    load_shard,
    run,
)
from tests.unit_tests.tools.checkpoint.test_checkpoint_conversion_mla import MLA

_MLA_DROPPED = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                "--max-position-embeddings")  # fmt: skip


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        dtype="float32",
    )
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, routers with preferences: a swap would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            if name.endswith("gate.weight"):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp("hf_deepseek_v3")
    model.save_pretrained(path)
    _add_mtp_layer(path / "model.safetensors")
    return path, model


def _add_mtp_layer(file):
    """DeepSeek's files hold the MTP depth as layer num_hidden_layers (transformers builds none):
    a random MoE layer shaped as layer 1, its norms and eh_proj, and copies of the embedding and
    head."""
    tensors = load_file(file)
    for name, tensor in list(tensors.items()):
        if name.startswith("model.layers.1."):
            tensors[name.replace("layers.1.", "layers.2.")] = torch.randn_like(tensor)
    h = tensors["model.norm.weight"].shape[0]
    tensors["model.layers.2.enorm.weight"] = torch.rand(h) + 0.5
    tensors["model.layers.2.hnorm.weight"] = torch.rand(h) + 0.5
    tensors["model.layers.2.shared_head.norm.weight"] = torch.rand(h) + 0.5
    tensors["model.layers.2.eh_proj.weight"] = torch.randn(h, 2 * h)
    tensors["model.layers.2.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.2.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, file, metadata={"format": "pt"})


def check_logits(hf_model, ckpt, seq=16):
    """Our GPTModel (its MTP depth included) from the one-file checkpoint's saved args, as the
    trainer's model provider builds it, loads it strictly and gives transformers' logits."""
    state = load_shard(ckpt)
    args = state["args"]
    config = core_transformer_config_from_args(args)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(
        config,
        spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        mtp_block_spec=mtp_layer_spec(spec) if args.mtp_num_layers else None,
    ).eval()
    model.load_state_dict(without_extra_state(state["model"]), strict=True)
    written = with_extra_state(model, model.state_dict())
    extra = {k: v for k, v in state["model"].items() if k.endswith("._extra_state")}
    assert extra == {k: v for k, v in written.items() if not torch.is_tensor(v)}
    tokens = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens, None, None)[..., :VOCAB]
        theirs = hf_model(input_ids=tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    assert theirs.abs().max().item() > 1e-2  # not vacuous
    return args


def _layout(tp, pp, ep):
    return [
        "--target-tensor-parallel-size", tp, "--target-pipeline-parallel-size", pp,
        "--target-expert-model-parallel-size", ep,
    ]  # fmt: skip


def _to_hf_and_compare(ours, back, src):
    run("--loader", "core", "--saver", "hf_deepseek_v3", "--load-dir", ours, "--save-dir", back)
    assert_same_tensors(src, back)
    model, info = DeepseekV3ForCausalLM.from_pretrained(back, output_loading_info=True)
    # transformers skips DeepSeek's MTP layer (it ignores only layer 61 by name: here 2 is left).
    unexpected = info.pop("unexpected_keys")
    assert unexpected and all(k.startswith("model.layers.2.") for k in unexpected), unexpected
    assert not any(info.values()), info


def test_round_trips_at_several_layouts_are_bit_exact(deepseek_dir, tmp_path):
    src, _ = deepseek_dir
    split = tmp_path / "tp2pp2ep2"
    run("--loader", "hf_deepseek_v3", "--saver", "core", "--load-dir", src, "--save-dir", split,
        *_layout(2, 2, 2))  # fmt: skip
    assert sorted(os.listdir(split / "release")) == [
        f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2) for p in range(2) for e in range(2)
    ]
    reader = TorchCheckpointReader(split)
    saved = reader.args
    assert (reader.tp, reader.pp, reader.ep) == (2, 2, 2)
    # What a --use-checkpoint-args run (and the printed flags) need to rebuild the model.
    assert saved.multi_latent_attention and saved.q_lora_rank == 16 and saved.qk_layernorm
    assert (saved.num_experts, saved.moe_router_topk, saved.moe_layer_freq) == (4, 2, [0, 1])
    assert saved.moe_router_score_function == "sigmoid" and saved.moe_router_enable_expert_bias
    assert (saved.moe_router_num_groups, saved.moe_router_group_topk) == (2, 1)
    assert saved.moe_router_topk_scaling_factor == 2.5
    assert saved.moe_shared_expert_intermediate_size == 16 and saved.moe_ffn_hidden_size == 16
    assert saved.mtp_num_layers == 1
    # The MTP depth sits on the last stage; its experts are split over EP like the decoder's.
    last = torch.load(
        split / "release" / "mp_rank_01_001_001" / "model_optim_rng.pt", weights_only=False
    )["model"]
    assert "mtp.layers.0.eh_proj.weight" in last and last["mtp.layers.0.eh_proj.weight"].shape == (
        16,
        64,
    )
    first = torch.load(
        split / "release" / "mp_rank_01_000_001" / "model_optim_rng.pt", weights_only=False
    )["model"]
    # The last stage embeds for its MTP depth: its own copy of the (TP-sharded) embedding.
    word = "embedding.word_embeddings.weight"
    assert torch.equal(last[word], first[word])
    expert = "mtp.layers.0.transformer_layer.mlp.experts.local_experts."
    assert sorted({k[len(expert)] for k in last if k.startswith(expert)}) == ["0", "1"]
    _to_hf_and_compare(split, tmp_path / "back_split", src)

    other = tmp_path / "tp1pp2ep4"
    run("--loader", "hf_deepseek_v3", "--saver", "core", "--load-dir", src, "--save-dir", other,
        *_layout(1, 2, 4))  # fmt: skip
    _to_hf_and_compare(other, tmp_path / "back_other", src)


def test_reshard_then_logits_and_back(deepseek_dir, tmp_path):
    src, model = deepseek_dir
    split, one = tmp_path / "tp2pp2ep2", tmp_path / "one"
    run("--loader", "hf_deepseek_v3", "--saver", "core", "--load-dir", src, "--save-dir", split,
        *_layout(2, 2, 2))  # fmt: skip
    run("--loader", "core", "--saver", "core", "--load-dir", split, "--save-dir", one,
        *_layout(1, 1, 1))  # fmt: skip
    assert os.listdir(one / "release") == ["mp_rank_00"]
    check_logits(model, one, seq=16)
    _to_hf_and_compare(one, tmp_path / "back", src)


def test_unmappable_config_fails_in_one_line(deepseek_dir, tmp_path):
    src, _ = deepseek_dir
    bad = tmp_path / "bad"
    bad.mkdir()
    os.symlink(src / "model.safetensors", bad / "model.safetensors")
    with open(src / "config.json") as f:
        config = json.load(f)
    for field, value, match in (
        ("hidden_act", "gelu", r"config.json: hidden_act='gelu' is not supported"),
        ("norm_topk_prob", False, "only the sigmoid router with norm_topk_prob"),
    ):
        with open(bad / "config.json", "w") as f:
            json.dump({**config, field: value}, f)
        with pytest.raises(ConversionError, match=match) as caught:
            run("--loader", "hf_deepseek_v3", "--saver", "core", "--load-dir", bad,
                "--save-dir", tmp_path / "never")  # fmt: skip
        assert "\n" not in str(caught.value)
    assert not (tmp_path / "never").exists()


def _megatron_mla_checkpoint(path, *flags):
    """A Megatron-born dense MLA model (test_checkpoint_conversion_mla's: q-LoRA, YaRN with
    factor 4 and mscale 0.7) written as the trainer writes a torch-format checkpoint."""
    args = tiny_args(*MLA, "--norm-epsilon", 1e-6, *flags, drop=_MLA_DROPPED)
    args.padded_vocab_size = 256
    config = core_transformer_config_from_args(args)
    torch.manual_seed(0)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(multi_latent_attention=True),
        vocab_size=256,
        max_sequence_length=32,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    ).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    writer = TorchCheckpointWriter(str(path), args, 7, False, torch.float32, True)
    for name, tensor in model.state_dict().items():
        writer.add(name, tensor)
    writer.write()
    return model


def test_megatron_born_mla_model_gives_its_logits_in_transformers(tmp_path):
    """The saver's config alone (no Hugging Face source): YaRN, mscale, q-LoRA, all-dense."""
    model = _megatron_mla_checkpoint(tmp_path / "src")
    run("--loader", "core", "--saver", "hf_deepseek_v3", "--load-dir", tmp_path / "src",
        "--save-dir", tmp_path / "hf")  # fmt: skip
    hf, info = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens, None, None), hf.eval()(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    assert theirs.abs().max().item() > 1e-2
    # Under plain RoPE Megatron still scales the softmax by mscale(factor, mscale_all_dim)^2;
    # Hugging Face cannot say so: refused in one line.
    _megatron_mla_checkpoint(tmp_path / "rope", "--rope-type", "rope")
    with pytest.raises(ConversionError, match="--rope-type rope with --rotary-scaling-factor > 1"):
        run("--loader", "core", "--saver", "hf_deepseek_v3", "--load-dir", tmp_path / "rope",
            "--save-dir", tmp_path / "never")  # fmt: skip
