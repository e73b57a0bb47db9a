"""Ask a running text generation server (tools/run_text_generation_server.py) for completions.

    python tools/text_generation_cli.py localhost:5000                     # prompts from stdin
    python tools/text_generation_cli.py localhost:5000 "Once upon" "The"   # these prompts
        [--tokens-to-generate 64] [--temperature T] [--top_k K] [--top_p P] [--random-seed S]

Each completion (prompt + generated text) is printed after ``Megatron Response: ``. A request
the server refuses prints its message as ``error: ...``; an unreachable server ends the CLI.
"""

import argparse
import json
import sys
import urllib.error
import urllib.request


def put(url: str, body: dict, timeout: float = 600.0) -> dict:
    """PUT ``body`` as JSON; returns the decoded answer, raises ValueError with the server's
    message for an HTTP error."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="PUT",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read().decode())
    except urllib.error.HTTPError as exc:
        raise ValueError(exc.read().decode(errors="replace").strip() or str(exc)) from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("server", help="host:port of the server (e.g. localhost:5000)")
    parser.add_argument("prompts", nargs="*", help="prompts (default: one per line of stdin)")
    parser.add_argument("--tokens-to-generate", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--top_p", type=float, default=None)
    parser.add_argument("--random-seed", type=int, default=None)
    args = parser.parse_args(argv)
    url = args.server if "://" in args.server else f"http://{args.server}"
    url = url.rstrip("/") + "/api"
    options = {"tokens_to_generate": args.tokens_to_generate}
    for field, value in (
        ("temperature", args.temperature),
        ("top_k", args.top_k),
        ("top_p", args.top_p),
        ("random_seed", args.random_seed),
    ):
        if value is not None:
            options[field] = value

    def ask(prompts) -> bool:
        try:
            answer = put(url, {"prompts": prompts, **options})
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return False
        for text in answer["text"]:
            print(f"Megatron Response: {text}", flush=True)
        return True

    try:
        if args.prompts:
            return 0 if ask(args.prompts) else 1
        interactive = sys.stdin.isatty()
        while True:
            if interactive:
                print("Enter prompt: ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                return 0
            ask([line.rstrip("\n")])
    except urllib.error.URLError as exc:
        print(f"error: cannot reach the server at {url}: {exc.reason}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
