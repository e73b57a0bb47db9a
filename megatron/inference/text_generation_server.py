"""Megatron's REST API over a :class:`TextGenerationEngine`, served by Flask (werkzeug).

``PUT /api`` with a JSON body (the fields of api_request.py) answers
``{"text": [...], "segments": [...], "tokens": [...], "logprobs": [...] or null}``; a bad
request answers HTTP 400 with a one-line plain-text message naming the field, and the server
goes on serving. Requests are handled one at a time (generation runs every rank in step).
SIGINT / SIGTERM stop the server cleanly: the current request finishes, the other ranks are
released, and :meth:`MegatronServer.run` returns.
"""

import signal
import threading
from typing import Callable

from flask import Flask, request
from werkzeug.serving import make_server

from megatron.inference.api_request import RequestDefaults, RequestError, parse_request


def create_app(engine, defaults: RequestDefaults, vocab_size: int, max_prompts: int) -> Flask:
    """The Flask app of the REST API."""
    app = Flask("megatron_text_generation")

    @app.route("/api", methods=["PUT"])
    def api():
        body = request.get_json(force=True, silent=True)
        if body is None:
            return "the request body is not valid JSON", 400
        try:
            checked = parse_request(body, defaults, vocab_size, max_prompts)
            if not checked.no_log:
                print(f"request: {len(checked.prompts)} prompt(s)", flush=True)
            return engine.handle(checked)
        except RequestError as exc:
            return str(exc), 400

    return app


class MegatronServer:
    """Serves ``app`` on host:port until SIGINT / SIGTERM (port 0: a free port)."""

    def __init__(self, app: Flask, host: str, port: int):
        self.server = make_server(host, port, app, threaded=False)
        self.host = host
        self.port = self.server.server_port

    def run(self, on_ready: Callable[[str], None] = print) -> None:
        previous = {}
        stoppers = []

        def stop(signum, frame):
            # shutdown() waits for serve_forever to return: it must run on another thread.
            stopper = threading.Thread(target=self.server.shutdown, daemon=True)
            stoppers.append(stopper)
            stopper.start()

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, stop)
        try:
            on_ready(f"serving text generation on http://{self.host}:{self.port}/api")
            self.server.serve_forever()
        finally:
            # A daemon thread still running at interpreter exit is ended inside the runtime,
            # which can abort the process ("terminate called without an active exception").
            for stopper in stoppers:
                stopper.join()
            self.server.server_close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
