"""The HTTP server's own flags of ``kvserve serve`` (what it binds, limits, records and
logs); ``kvserve.replicas.flags.add_serve_args`` joins them to the replicas' and the
engine's."""
from __future__ import annotations

import argparse

from kvserve.config.observability import METRICS_PREFIXES
from kvserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from kvserve.entrypoints.openai.tool_parsers import TOOL_PARSERS


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="model directory in Hugging Face layout (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 and tokenize routes "
                        "(default: $KVSERVE_API_KEY, else no key)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients use (default: the model directory's name)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="answer 429 while this many requests wait (default: 1024)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20,
                   help="largest request body; larger ones get 413 (default: 8 MiB)")
    p.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between throughput log lines; 0 disables (default: 10)")
    p.add_argument("--metrics-prefix", default="kvserve", choices=METRICS_PREFIXES,
                   help="name the Prometheus series kvserve:... or vllm:... (vLLM's own "
                        "dashboards and alerts then read them unchanged; default: kvserve)")
    p.add_argument("--otlp-traces-endpoint", default=None,
                   help="send one OpenTelemetry span per request to this OTLP/HTTP "
                        "collector, e.g. http://127.0.0.1:4318/v1/traces (default: off)")
    p.add_argument("--state-dir", default=None,
                   help="where the Batch API keeps its database and files (default: "
                        "$XDG_CACHE_HOME/kvserve/state, else ~/.cache/kvserve/state)")
    p.add_argument("--max-batch-lines-in-flight", type=int, default=None,
                   help="batch lines in the engine at once while no realtime request is in "
                        "flight; fewer while some are (default: 2 x max_num_seqs)")
    p.add_argument("--max-batch-file-bytes", type=int, default=200 * 2**20,
                   help="largest file /v1/files accepts (default and OpenAI's limit: 200 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before "
                        "aborting them (default: 30)")
    p.add_argument("--disable-access-log", action="store_true",
                   help="do not log one line per HTTP request")
    p.add_argument("--tool-call-parser", default="hermes", choices=TOOL_PARSERS.names(),
                   help="how the model writes tool calls (default: hermes)")
    p.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="let the model choose whether to call a tool (tool_choice 'auto', "
                        "OpenAI's default when tools are given); needs a chat template "
                        "that shows the model its tools (default: on)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, as a file or its text, used instead of the "
                        "model's (default: the model's own)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=DIR",
                   help="LoRA adapters (PEFT directories) served from the start, each as "
                        "name=path or JSON {\"name\": .., \"path\": ..}; a request's model "
                        "field names one (needs --enable-lora)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS.names(),
                   help="split a reasoning model's chat answers into reasoning_content "
                        "(its <think> block) and content (default: off)")
