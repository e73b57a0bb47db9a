"""Pipeline schedules (1F1B and interleaved) against the single-process model, in one gloo world
of 4.

For each layout every rank builds the full model (the reference) and its own stage chunks with
``pre_process``/``post_process``/``num_layers``/``layer_number_offset`` from the layer split,
copies the reference weights into them (the tied output weight of the last stage arrives through
``sync_shared_embedding``), wraps each chunk in DDP and runs the schedule. Checks:

* every (virtual stage, micro-batch) has exactly one forward and one backward, and the events
  respect the data dependencies (F on virtual stage v after F on v-1 has finished, B on v after B on
  v+1 and after its own F), from timestamps of a system-wide monotonic clock;
* the number of micro-batches in flight on each rank equals the 1F1B bound (warm-up + 1, capped);
* the per-micro-batch losses on the last stage equal the reference's, and every gradient (after
  ``finalize_model_grads``, incl. the tied embedding summed over first and last stage) equals the
  reference gradient of the same parameter: ||a - b|| / ||b|| <= 1e-5 (fp32);
* forward-only mode gives the same losses and the same F events and no backward.
"""

import functools

import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron.core.pipeline_parallel.layer_split import compute_layer_split
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.pipeline_parallel.step_context import StepContext
from megatron.core.tensor_parallel import ProcessGroupCollection
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.tiny_configs import tiny_transformer_config

RTOL = 1e-5
VOCAB, SEQ, MBS, HIDDEN = 32, 8, 2, 16


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make_config(num_layers):
    return tiny_transformer_config(
        num_layers=num_layers, hidden_size=HIDDEN, ffn_hidden_size=32, num_attention_heads=2
    )


def build(config, tied, **kwargs):
    # One process unless groups are given (GPTModel would take the current parallel_state's).
    if kwargs.get("pg_collection") is None:
        kwargs["pg_collection"] = ProcessGroupCollection()
    return GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=tied,
        **kwargs,
    )


def make_batches(m, seed):
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(m):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        loss_mask = (torch.rand(MBS, SEQ, generator=g) > 0.2).float()
        batches.append(
            dict(
                tokens=tokens,
                labels=labels,
                loss_mask=loss_mask,
                position_ids=torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ),
            )
        )
    return batches


def loss_func(loss_mask, output_tensor):
    total = (output_tensor.float() * loss_mask).sum()
    n = loss_mask.sum().int()
    return total, n, {"lm loss": torch.stack([total.detach(), n.float()])}


def forward_step_func(data_iterator, model):
    batch = next(data_iterator)
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return out, functools.partial(loss_func, batch["loss_mask"])


def reference(full, batches):
    """Independent reference: mean over micro-batches of the per-token mean loss, one backward."""
    full.zero_grad()
    per_mb = []
    total = 0.0
    for b in batches:
        losses = full(b["tokens"], b["position_ids"], None, labels=b["labels"])
        s = (losses * b["loss_mask"]).sum()
        per_mb.append(s.detach() / b["loss_mask"].sum())
        total = total + s / b["loss_mask"].sum()
    (total / len(batches)).backward()
    return per_mb, {name: p.grad.clone() for name, p in full.named_parameters()}


def stage_name_to_full(name, offset):
    if name.startswith("decoder.layers."):
        rest = name[len("decoder.layers.") :]
        idx, tail = rest.split(".", 1)
        return f"decoder.layers.{int(idx) + offset}.{tail}"
    if name == "output_layer.weight":
        return name
    return name


def check_events(events, pp, vp, m, forward_only, tag, group_size=None):
    nvs = pp * vp
    by_key = {}
    for e in events:
        v = e.chunk * pp + e.stage
        key = (e.kind, v, e.microbatch)
        assert key not in by_key, f"{tag}: duplicate event {key}"
        by_key[key] = e
    kinds = ("F",) if forward_only else ("F", "B")
    expected = {(k, v, mb) for k in kinds for v in range(nvs) for mb in range(m)}
    assert set(by_key) == expected, f"{tag}: events missing/extra: {sorted(set(by_key) ^ expected)}"
    for (kind, v, mb), e in by_key.items():
        if kind == "F" and v > 0:
            before = by_key[("F", v - 1, mb)]
            assert e.start_ns >= before.end_ns, (
                f"{tag}: F(v={v}, mb={mb}) started before F(v={v - 1}) ended"
            )
        if kind == "B":
            own = by_key[("F", v, mb)]
            assert e.start_ns >= own.end_ns, (
                f"{tag}: B(v={v}, mb={mb}) started before its forward ended"
            )
            if v < nvs - 1:
                after = by_key[("B", v + 1, mb)]
                assert e.start_ns >= after.end_ns, (
                    f"{tag}: B(v={v}, mb={mb}) started before B(v={v + 1}) ended"
                )
    if forward_only:
        return
    # 1F1B memory bound: the micro-batches in flight on each rank never exceed warm-up + 1.
    group = group_size or pp
    for stage in range(pp):
        mine = sorted((e for e in events if e.stage == stage), key=lambda e: e.start_ns)
        inflight = peak = 0
        for e in mine:
            inflight += 1 if e.kind == "F" else -1
            peak = max(peak, inflight)
        if vp == 1:
            bound = min(pp - stage, m)
        else:
            bound = min((pp - stage - 1) * 2 + (vp - 1) * group + 1, m * vp)
        assert peak == bound, (
            f"{tag}: stage {stage} had {peak} micro-batches in flight, 1F1B allows {bound}"
        )


def run_case(rank, pp, vp, m, num_layers, tied, split_kwargs=None, group_size=None):
    tag = (
        f"pp={pp} vp={vp} m={m} layers={num_layers} tied={tied} {split_kwargs or ''} G={group_size}"
    )
    state = initialize_model_parallel(
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp if vp > 1 else None
    )
    try:
        pp_rank = state.get_pipeline_model_parallel_rank()
        config = make_config(num_layers)
        torch.manual_seed(1234)
        full = build(config, tied)
        split = compute_layer_split(num_layers, pp, vp if vp > 1 else None, **(split_kwargs or {}))
        chunks, offsets = [], []
        for c in range(vp):
            args = split.chunk_args(pp_rank, c)
            chunk = build(config, tied, **args)
            full_state = full.state_dict()
            with torch.no_grad():
                for name, p in chunk.named_parameters():
                    if tied and name == "output_layer.weight":
                        continue  # stays zero until sync_shared_embedding
                    p.copy_(full_state[stage_name_to_full(name, args["layer_number_offset"])])
            chunk.sync_shared_embedding(state.get_embedding_group())
            if tied and args["post_process"] and not args["pre_process"]:
                assert torch.equal(
                    chunk.output_layer.weight, full.embedding.word_embeddings.weight
                ), tag
            chunks.append(chunk)
            offsets.append(args["layer_number_offset"])
        ddp = [
            DistributedDataParallel(
                c.config,
                DistributedDataParallelConfig(),
                c,
                pg_collection=ProcessGroupCollection(dp_cp=state.get_data_parallel_group()),
            )
            for c in chunks
        ]
        batches = make_batches(m, seed=17)
        ref_losses, ref_grads = reference(full, batches)

        events = []
        step_context = StepContext(
            microbatch_group_size_per_vp_stage=group_size, pipeline_event_callback=events.append
        )
        func = get_forward_backward_func(pp, vp if vp > 1 else None)
        for d in ddp:
            d.zero_grad_buffer()
        iters = [iter(batches) for _ in range(vp)]
        losses = func(
            forward_step_func=forward_step_func,
            data_iterator=iters if vp > 1 else iters[0],
            model=ddp if vp > 1 else ddp[0],
            num_microbatches=m,
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=False,
            pg_collection=state,
            step_context=step_context,
        )
        finalize_model_grads(ddp, pg_collection=state)

        gathered = [None] * dist.get_world_size(state.get_pipeline_model_parallel_group())
        dist.all_gather_object(gathered, events, group=state.get_pipeline_model_parallel_group())
        check_events([e for r in gathered for e in r], pp, vp, m, False, tag, group_size)

        if state.is_pipeline_last_stage():
            assert len(losses) == m, tag
            for got, want in zip(losses, ref_losses):
                value = got["lm loss"][0] / got["lm loss"][1]
                assert rel_err(value, want) <= RTOL, f"{tag}: loss {value} vs {want}"
        else:
            assert losses == [], tag
        for c, chunk in enumerate(chunks):
            for name, p in chunk.named_parameters():
                full_name = stage_name_to_full(name, offsets[c])
                if tied and name == "output_layer.weight":
                    full_name = "embedding.word_embeddings.weight"
                err = rel_err(p.main_grad, ref_grads[full_name])
                assert err <= RTOL, f"{tag}: grad of {name} (chunk {c}) rel err {err:.2e}"

        # Forward-only (evaluation): same losses, forward events only.
        events.clear()
        iters = [iter(batches) for _ in range(vp)]
        with torch.no_grad():
            losses = func(
                forward_step_func=forward_step_func,
                data_iterator=iters if vp > 1 else iters[0],
                model=ddp if vp > 1 else ddp[0],
                num_microbatches=m,
                seq_length=SEQ,
                micro_batch_size=MBS,
                forward_only=True,
                pg_collection=state,
                step_context=step_context,
            )
        dist.all_gather_object(gathered, events, group=state.get_pipeline_model_parallel_group())
        check_events([e for r in gathered for e in r], pp, vp, m, True, tag + " forward-only")
        if state.is_pipeline_last_stage():
            for got, want in zip(losses, ref_losses):
                assert rel_err(got["lm loss"][0] / got["lm loss"][1], want) <= RTOL, tag
    finally:
        destroy_model_parallel()


def _world(rank, world_size):
    torch.set_num_threads(1)
    # PP = 4 without interleaving: fewer, equal and more micro-batches than stages.
    for m in (1, 4, 6):
        run_case(rank, pp=4, vp=1, m=m, num_layers=4, tied=True)
    # Uneven first/last stages and embedding/loss accounting.
    run_case(
        rank,
        pp=4,
        vp=1,
        m=3,
        num_layers=6,
        tied=False,
        split_kwargs=dict(decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=1),
    )
    run_case(
        rank,
        pp=4,
        vp=1,
        m=2,
        num_layers=6,
        tied=True,
        split_kwargs=dict(
            account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True
        ),
    )
    # PP = 4 interleaved (2 chunks per rank): M = PP, 2*PP, and a group size G = 6 with remainder 4.
    run_case(rank, pp=4, vp=2, m=4, num_layers=8, tied=True)
    run_case(rank, pp=4, vp=2, m=8, num_layers=8, tied=False)
    run_case(rank, pp=4, vp=2, m=10, num_layers=8, tied=True, group_size=6)
    # PP = 2 (two pipelines side by side, DP = 2), with and without interleaving.
    for m in (1, 3):
        run_case(rank, pp=2, vp=1, m=m, num_layers=4, tied=True)
    run_case(rank, pp=2, vp=2, m=2, num_layers=4, tied=True)
    run_case(rank, pp=2, vp=3, m=5, num_layers=6, tied=False, group_size=3)


def test_pipeline_schedules_match_single_process():
    run_distributed(_world, 4)
