"""Serve text generation from a GPT checkpoint over Megatron's REST API.

    torchrun --nproc-per-node N tools/run_text_generation_server.py <pretrain_gpt.py flags> \
        --load <checkpoint> [--port 5000] [--host 127.0.0.1] [--temperature 1.0] [--top_k 1]

The model flags are pretrain_gpt.py's (``--use-checkpoint-args`` reads them from the
checkpoint). Global rank 0 (first pipeline stage, tensor-parallel rank 0) runs the HTTP server;
every other rank follows its commands. ``PUT /api`` takes Megatron's request fields; a request
that leaves out ``temperature`` / ``top_k`` / ``top_p`` gets the server's flags. Ctrl-C or
SIGTERM stops every rank cleanly.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

import torch  # noqa: E402

from megatron.core.device import compute_device  # noqa: E402
from megatron.core.inference.model_forward import InferenceModelForward  # noqa: E402
from megatron.inference.api_request import MAX_PROMPTS, RequestDefaults  # noqa: E402
from megatron.inference.engine import TextGenerationEngine  # noqa: E402
from megatron.inference.text_generation_server import MegatronServer, create_app  # noqa: E402
from megatron.training import get_args, get_parallel_state, get_tokenizer  # noqa: E402
from megatron.training.checkpointing import load_checkpoint  # noqa: E402
from megatron.training.initialize import initialize_megatron  # noqa: E402
from megatron.training.model_families import get_model_family  # noqa: E402
from megatron.training.training import get_model, leave_process_group  # noqa: E402

model_provider = get_model_family("gpt").model_provider


def add_text_generate_args(parser):
    """Megatron's text-generation server flags (plus --host)."""
    group = parser.add_argument_group(title="text generation")
    group.add_argument(
        "--port", type=int, default=5000, help="Port of the server (0: any free port)."
    )
    group.add_argument(
        "--host",
        type=str,
        default="127.0.0.1",
        help="Address to bind (0.0.0.0 serves every interface; default: loopback only).",
    )
    group.add_argument(
        "--temperature", type=float, default=1.0, help="Sampling temperature of requests."
    )
    group.add_argument(
        "--top_k", type=int, default=1, help="Top-k sampling of requests (1: greedy)."
    )
    group.add_argument("--top_p", type=float, default=0.0, help="Top-p sampling of requests.")
    return parser


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def _check_server_args(args) -> None:
    if not 0 <= args.port <= 65535:
        _fail(f"--port {args.port} is not a TCP port (0-65535)")
    if not 0.0 < args.temperature <= 100.0:
        _fail(f"--temperature {args.temperature} must be in (0, 100]")
    if args.top_k < 0:
        _fail(f"--top_k {args.top_k} must be >= 0")
    if not 0.0 <= args.top_p <= 1.0:
        _fail(f"--top_p {args.top_p} must be within [0, 1]")
    if args.top_k > 0 and args.top_p > 0.0:
        _fail(f"--top_k {args.top_k} and --top_p {args.top_p} cannot both be set")
    if args.inference_max_requests < 1:
        _fail(f"--inference-max-requests {args.inference_max_requests} must be >= 1")
    if args.inference_max_seq_length < 1:
        _fail(f"--inference-max-seq-length {args.inference_max_seq_length} must be >= 1")
    if args.load is None:
        _fail("--load is required: the checkpoint to serve")
    if args.virtual_pipeline_model_parallel_size is not None:
        _fail("text generation does not support virtual pipeline stages")
    if args.context_parallel_size > 1 or args.sequence_parallel:
        _fail(
            "text generation supports neither --context-parallel-size > 1 nor --sequence-parallel"
        )


def main(argv=None) -> None:
    initialize_megatron(
        extra_args_provider=add_text_generate_args,
        # No training happens: the training-length flag is not required.
        args_defaults={"train_iters": 1},
        argv=argv,
    )
    args = get_args()
    _check_server_args(args)
    _serve(args)
    # The model and the engine were _serve's locals. No barrier: after EXIT no rank
    # communicates, and a rank that failed to bind its port has already left.
    leave_process_group(wait_for_all=False)


@torch.no_grad()
def _serve(args) -> None:
    """Load the model and serve it (global rank 0) or follow the serving rank (the others)."""
    model = get_model(model_provider, wrap_with_ddp=False)
    # Only the model weights are read (Megatron's server passes no optimizer either), and a
    # missing checkpoint is an error: a server of random weights is never what was meant.
    load_checkpoint(
        model, None, None, strict=True, load_optim=False, load_rng=False, exit_on_missing=True
    )
    model = model[0]
    model.eval()

    state = get_parallel_state()
    tokenizer = get_tokenizer()
    config = model.config
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    if args.fp32_residual_connection:
        dtype = torch.float32
    step = InferenceModelForward(
        model,
        vocab_size=tokenizer.vocab_size,
        hidden_size=config.hidden_size,
        dtype=dtype,
        pp_group=state.get_pipeline_model_parallel_group()
        if args.pipeline_model_parallel_size > 1
        else None,
        tp_group=state.get_tensor_model_parallel_group()
        if args.tensor_model_parallel_size > 1
        else None,
    )
    engine = TextGenerationEngine(
        step,
        tokenizer,
        max_sequence_length=min(args.max_position_embeddings, args.inference_max_seq_length),
        max_tokens=args.max_tokens_to_oom,
        device=compute_device(),
        max_batch_size=args.inference_max_requests,
    )
    if args.rank != 0:
        engine.follow()
        return
    app = create_app(
        engine,
        RequestDefaults(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p),
        vocab_size=tokenizer.vocab_size,
        max_prompts=MAX_PROMPTS,
    )
    try:
        server = MegatronServer(app, args.host, args.port)
    except OSError as exc:
        engine.stop_followers()
        _fail(f"cannot serve on --host {args.host} --port {args.port}: {exc.strerror or exc}")
    try:
        # The pid is the process to signal for a clean stop of every rank (under torchrun).
        server.run(on_ready=lambda line: print(f"{line} (pid {os.getpid()})", flush=True))
    finally:
        engine.stop_followers()
    print("text generation server stopped", flush=True)


if __name__ == "__main__":
    main()
