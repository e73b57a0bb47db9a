"""tools/run_text_generation_server.py answering a real HTTP client on loopback, on one process
and under TP=2 and PP=2 (torchrun, gloo), serving a tiny random GPT-2 converted from Hugging
Face by tools/checkpoint/convert.py; and a tiny mixture-of-experts GPT saved by pretrain_gpt.py
in the torch_dist format, served on one process and under expert parallelism (EP=2).

References: ``transformers``' greedy ``generate`` and its log-softmax for the one-process
server; the one-process server's answers for TP=2, PP=2 and EP=2.
"""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
import transformers

from tests.functional_tests.runner import REPO, env_for_tests, run_pretrain
from tests.harness.argv import megatron_argv

sys.path.insert(0, str(REPO / "tools" / "checkpoint"))
import convert  # noqa: E402

VOCAB = 8192  # tests/data/gpt2-vocab.json
MODEL_FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--max-position-embeddings", "64", "--seq-length", "64",
    "--position-embedding-type", "learned_absolute", "--normalization", "LayerNorm",
    "--norm-epsilon", "1e-05", "--make-vocab-size-divisible-by", "128", "--ckpt-format", "torch",
    "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", str(REPO / "tests/data/gpt2-vocab.json"),
    "--merge-file", str(REPO / "tests/data/gpt2-merges.txt"),
    "--micro-batch-size", "1", "--port", "0",
]  # fmt: skip
READY = re.compile(r"serving text generation on (http://127\.0\.0\.1:\d+/api) \(pid (\d+)\)")
PROMPTS = ["Return the value of", "The"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """An HF GPT-2 (random, large init so that no two logits tie) and its conversions at
    TP/PP = 1/1, 2/1 and 1/2."""
    root = tmp_path_factory.mktemp("textgen")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        initializer_range=0.2,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(root / "hf")
    dirs = {}
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        out = root / f"ckpt_tp{tp}_pp{pp}"
        convert.convert(
            ["--model-type", "GPT", "--loader", "hf_gpt2", "--saver", "core"]
            + ["--load-dir", str(root / "hf"), "--save-dir", str(out)]
            + ["--target-tensor-parallel-size", str(tp)]
            + ["--target-pipeline-parallel-size", str(pp)],
            in_process=True,
        )
        dirs[(tp, pp)] = out
    return model, dirs


class Server:
    """The server as a subprocess (torchrun with ``nproc``); stopped with SIGINT to rank 0."""

    def __init__(self, load, tp=1, pp=1, ep=1, model_flags=MODEL_FLAGS):
        script = str(REPO / "tools" / "run_text_generation_server.py")
        flags = model_flags + ["--load", str(load)]
        flags += ["--tensor-model-parallel-size", str(tp)]
        flags += ["--pipeline-model-parallel-size", str(pp)]
        # Experts are split over the data-parallel ranks: EP=2 alone needs two processes.
        flags += ["--expert-model-parallel-size", str(ep)]
        nproc = tp * pp * ep
        if nproc == 1:
            cmd = [sys.executable, script] + flags
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += ["--nproc-per-node", str(nproc), script] + flags
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env_for_tests(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines = queue.Queue()
        self.output = []
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + 120
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise AssertionError("server not ready in 120 s:\n" + "".join(self.output[-40:]))
            if line is None:
                raise AssertionError("server exited:\n" + "".join(self.output[-40:]))
            match = READY.search(line)
            if match:
                self.url, self.pid = match.group(1), int(match.group(2))
                return

    def _pump(self):
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def put(self, body, raw=None):
        """(status, decoded JSON or the plain-text message)."""
        data = raw if raw is not None else json.dumps(body).encode()
        request = urllib.request.Request(self.url, data=data, method="PUT")
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read().decode())
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def stop(self):
        """SIGINT to the serving rank; every rank must then exit 0."""
        os.kill(self.pid, signal.SIGINT)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("server did not stop:\n" + "".join(self.output[-40:])) from None
        assert code == 0, "".join(self.output[-40:])
        assert any("text generation server stopped" in line for line in self.output)

    def kill(self):
        """Stop everything after a failure: torchrun starts its workers in sessions of their
        own, so they are reached through torchrun's SIGTERM handling, not the process group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def single(checkpoints):
    """The one-process server, shared by the tests; stopping it cleanly is checked at the end."""
    server = Server(checkpoints[1][(1, 1)])
    try:
        yield server
        server.stop()
    finally:
        if server.proc.poll() is None:
            server.kill()


GREEDY = {"prompts": PROMPTS, "tokens_to_generate": 6, "logprobs": True, "top_k": 1}
SAMPLED = {"prompts": PROMPTS, "tokens_to_generate": 6, "top_k": 5, "random_seed": 3}

BAD_REQUESTS = [
    ({"tokens_to_generate": 3}, "prompts argument required"),
    ({"prompts": "just a string"}, "prompts is not a list of strings"),
    ({"prompts": []}, "prompts is empty"),
    ({"prompts": [""]}, "Empty prompts require add_BOS=true"),
    ({"prompts": ["a"], "tokens_to_generate": -1}, "tokens_to_generate must be an integer"),
    ({"prompts": ["a"], "tokens_to_generate": "5"}, "tokens_to_generate must be an integer"),
    ({"prompts": ["a"], "tokens_to_generate": 0}, "tokens_to_generate=0 implies logprobs"),
    ({"prompts": ["a"], "tokens_to_generate": 80}, "more than the server's maximum of 64"),
    ({"prompts": ["a"], "temperature": 0}, "temperature must be a positive number"),
    ({"prompts": ["a"], "top_k": 2, "top_p": 0.5}, "cannot set both top-k and top-p"),
    ({"prompts": ["a"], "top_p": 1.5}, "top_p must be a number within [0, 1]"),
    ({"prompts": ["a"], "logprobs": "yes"}, "logprobs must be a boolean value"),
    ({"prompts": ["a"], "random_seed": -2}, "random_seed must be a non-negative integer"),
    ({"prompts": ["a"], "stop_token": VOCAB}, "stop_token must be a token id"),
    ({"prompts": ["a"] * 129}, "Maximum number of prompts is 128"),
    ({"prompts": ["a"], "max_len": 5}, "max_len is no longer used"),
    ({"prompts": ["a"], "length_penalty": 2}, "length_penalty applies to beam search"),
    ({"prompts": ["a"], "temprature": 1.0}, "unknown field(s) temprature"),
    ([1, 2], "the request body must be a JSON object"),
]


def hf_reference(model, prompt_ids, n):
    """transformers' greedy generate and the log-probs of every token given its prefix."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=VOCAB - 1,
            eos_token_id=None,
        )
        logits = model(out).logits[0, :-1].double()
    log_probs = logits.log_softmax(-1).gather(1, out[0, 1:, None]).squeeze(1)
    return out[0].tolist(), log_probs


def test_server_one_process_matches_transformers_and_refuses_bad_requests(checkpoints, single):
    model, _ = checkpoints
    hf_tok = transformers.AutoTokenizer.from_pretrained(REPO / "tests/data/hf-tokenizer")
    server = single
    status, answer = server.put(GREEDY)
    assert status == 200, answer
    assert set(answer) == {"text", "segments", "tokens", "logprobs"}
    total = max(len(hf_tok.encode(p)) for p in PROMPTS) + 6
    for i, prompt in enumerate(PROMPTS):
        ids = hf_tok.encode(prompt)
        want, want_log_probs = hf_reference(model, ids, total - len(ids))
        assert answer["tokens"][i] == want
        assert answer["text"][i] == hf_tok.decode(want)
        assert answer["text"][i].startswith(prompt)
        assert "".join(answer["segments"][i]) == answer["text"][i]
        assert len(answer["segments"][i]) == len(want)
        torch.testing.assert_close(
            torch.tensor(answer["logprobs"][i], dtype=torch.double),
            want_log_probs,
            rtol=0,
            atol=1e-4,
        )
    # More prompts than --inference-max-requests (8) run in consecutive batches.
    one = server.put({"prompts": ["The"], "tokens_to_generate": 3, "top_k": 1})
    nine = server.put({"prompts": ["The"] * 9, "tokens_to_generate": 3, "top_k": 1})
    assert one[0] == nine[0] == 200
    assert nine[1]["tokens"] == one[1]["tokens"] * 9 and nine[1]["text"] == one[1]["text"] * 9
    # Seeded sampling repeats; without logprobs the field is null.
    first = server.put(SAMPLED)
    assert first[0] == 200 and first[1]["logprobs"] is None
    assert server.put(SAMPLED) == first
    for body, message in BAD_REQUESTS:
        status, text = server.put(body)
        assert status == 400 and message in text, (body, status, text)
    status, text = server.put(None, raw=b'{"prompts": ["a"')
    assert status == 400 and "not valid JSON" in text
    # Still serving after the bad requests.
    assert server.put(GREEDY) == (200, answer)
    # The CLI against the running server.
    cli = subprocess.run(
        [sys.executable, str(REPO / "tools" / "text_generation_cli.py")]
        + [server.url.rsplit("/", 1)[0], "--tokens-to-generate", "3", "--top_k", "1"],
        input="The\n",
        capture_output=True,
        text=True,
        timeout=60,
        env=env_for_tests(),
    )
    assert cli.returncode == 0, cli.stderr
    want, _ = hf_reference(model, hf_tok.encode("The"), 3)
    assert cli.stdout == f"Megatron Response: {hf_tok.decode(want)}\n"


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_server_tp2_and_pp2_equal_one_process(checkpoints, single, tp, pp):
    _, dirs = checkpoints
    want_greedy = single.put(GREEDY)
    want_sampled = single.put(SAMPLED)
    server = Server(dirs[(tp, pp)], tp=tp, pp=pp)
    try:
        status, got = server.put(GREEDY)
        assert status == 200 and got["tokens"] == want_greedy[1]["tokens"]
        assert got["text"] == want_greedy[1]["text"]
        torch.testing.assert_close(
            torch.tensor(got["logprobs"]), torch.tensor(want_greedy[1]["logprobs"]),
            rtol=0, atol=1e-5,
        )  # fmt: skip
        assert server.put(SAMPLED) == want_sampled
        # A bad request is answered by the serving rank alone; the others keep following.
        status, text = server.put({"prompts": ["a"], "top_k": -1})
        assert status == 400 and "top_k must be an integer" in text
        assert server.put(SAMPLED) == want_sampled
        server.stop()
    finally:
        if server.proc.poll() is None:
            server.kill()


# A tiny MoE GPT (4 experts, top-2, dropless, alltoall dispatch); a large init so that no two
# logits tie. No --ckpt-format: pretrain_gpt.py's default, torch_dist (Megatron's layout).
MOE_MODEL_FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64",
    "--num-attention-heads", "4", "--max-position-embeddings", "64", "--seq-length", "64",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
    "--moe-token-dispatcher-type", "alltoall", "--init-method-std", "0.2",
    "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
    "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", str(REPO / "tests/data/gpt2-vocab.json"),
    "--merge-file", str(REPO / "tests/data/gpt2-merges.txt"),
    "--micro-batch-size", "1",
]  # fmt: skip


def test_server_moe_torch_dist_ep2_equals_one_process(tmp_path):
    """One iteration of pretrain_gpt.py (one process) saves the model in torch_dist; the
    one-process server and the EP=2 server (two experts per rank) read it and must agree."""
    save = tmp_path / "moe"
    # Mock data with the model's own tokenizer (not MOCK_DATA's NullTokenizer): the server
    # tokenizes the prompts with it.
    training = megatron_argv(
        base=None,
        mock_data=True,
        global_batch_size=1,
        train_iters=1,
        lr=1e-4,
        eval_iters=0,
        num_workers=0,
        seed=1234,
        save=save,
        save_interval=1,
    )
    result = run_pretrain(MOE_MODEL_FLAGS + training)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (save / "iter_0000001" / ".metadata").is_file()  # torch.distributed.checkpoint's
    answers = []
    for ep in (1, 2):
        server = Server(save, ep=ep, model_flags=MOE_MODEL_FLAGS + ["--port", "0"])
        try:
            answers.append((server.put(GREEDY), server.put(SAMPLED)))
            server.stop()
        finally:
            if server.proc.poll() is None:
                server.kill()
    (want_greedy, want_sampled), (got_greedy, got_sampled) = answers
    assert want_greedy[0] == got_greedy[0] == 200, (want_greedy, got_greedy)
    assert got_greedy[1]["tokens"] == want_greedy[1]["tokens"]
    assert got_greedy[1]["text"] == want_greedy[1]["text"]
    torch.testing.assert_close(
        torch.tensor(got_greedy[1]["logprobs"]), torch.tensor(want_greedy[1]["logprobs"]),
        rtol=0, atol=1e-5,
    )  # fmt: skip
    assert want_sampled[0] == 200 and got_sampled == want_sampled
