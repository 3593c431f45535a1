"""ServerMetrics: the server's Prometheus collectors.

The series of vLLM v1's Prometheus logger that apply to kvserve, with vLLM's names,
types, labels (``model_name``, ``engine``) and buckets, then kvserve's own. The prefix
is ``kvserve`` by default; ``--metrics-prefix vllm`` names them ``vllm:...`` so that
dashboards and alerts written for vLLM read kvserve unchanged. One
``CollectorRegistry`` per server, so several servers in one process never clash.
"""
from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, disable_created_metrics, generate_latest)

from kvserve.config.observability import METRICS_PREFIXES

FINISH_REASONS = ("stop", "length", "abort", "error")
TRANSFER_KINDS = ("swap_out", "swap_in", "offload", "onload")
STEP_PARTS = ("linear", "attention", "other")

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
PREFILL_TOKEN_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]
BATCH_ROW_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def one_two_five_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class ServerMetrics:
    """Attributes are label-bound children, ready to ``inc`` / ``set`` / ``observe``."""

    def __init__(self, model_name: str, max_model_len: int = 2048, prefix: str = "kvserve",
                 registry: CollectorRegistry | None = None) -> None:
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {', '.join(METRICS_PREFIXES)}; "
                             f"got {prefix!r}")
        disable_created_metrics()  # as vLLM: no *_created series beside every counter
        self.prefix = prefix
        self.registry = registry or CollectorRegistry()
        self.lora_requests_info = None  # a Gauge once LoRA adapters are served
        self.model_name = model_name
        self._labels = {"model_name": model_name, "engine": "0"}
        tokens = one_two_five_buckets(max_model_len)

        g, c, h = self._gauge, self._counter, self._histogram
        # -- vLLM's series ---------------------------------------------------------------
        self.num_requests_running = g("num_requests_running",
                                      "Number of requests in model execution batches.")
        self.num_requests_waiting = g("num_requests_waiting",
                                      "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = g("kv_cache_usage_perc",
                                     "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_cache_usage_perc = g("gpu_cache_usage_perc", "KV-cache usage. 1 means 100 "
                                      "percent usage. DEPRECATED (as in vLLM): use "
                                      "kv_cache_usage_perc.")
        self.prefix_cache_queries = c("prefix_cache_queries", "Prefix cache queries, in "
                                      "terms of number of queried tokens.")
        self.prefix_cache_hits = c("prefix_cache_hits", "Prefix cache hits, in terms of "
                                   "number of cached tokens.")
        self.gpu_prefix_cache_queries = c("gpu_prefix_cache_queries", "Prefix cache queries "
                                          "in tokens. DEPRECATED: use prefix_cache_queries.")
        self.gpu_prefix_cache_hits = c("gpu_prefix_cache_hits", "Prefix cache hits in "
                                       "tokens. DEPRECATED: use prefix_cache_hits.")
        self.num_preemptions = c("num_preemptions",
                                 "Cumulative number of preemption from the engine.")
        self.prompt_tokens = c("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = c("generation_tokens", "Number of generation tokens processed.")
        self.request_success = c("request_success", "Count of successfully processed requests.",
                                 finished_reason=FINISH_REASONS)
        self.request_prompt_tokens = h("request_prompt_tokens",
                                       "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = h("request_generation_tokens",
                                           "Number of generation tokens processed.", tokens)
        self.iteration_tokens = h("iteration_tokens_total",
                                  "Histogram of number of tokens per engine_step.",
                                  ITERATION_TOKEN_BUCKETS)
        self.request_max_num_generation_tokens = h(
            "request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", tokens)
        self.request_params_n = h("request_params_n", "Histogram of the n request parameter.",
                                  PARAMS_N_BUCKETS)
        self.request_params_max_tokens = h("request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.",
                                           tokens)
        self.time_to_first_token = h("time_to_first_token_seconds",
                                     "Histogram of time to first token in seconds.",
                                     TTFT_BUCKETS)
        self.time_per_output_token = h("time_per_output_token_seconds",
                                       "Histogram of time per output token in seconds.",
                                       TPOT_BUCKETS)
        self.inter_token_latency = h("inter_token_latency_seconds",
                                     "Histogram of inter-token latency in seconds.",
                                     ITL_BUCKETS)
        self.time_per_prefill_token = h("time_per_prefill_token_request_seconds",
                                        "Time spent per token during prefill phase in seconds",
                                        PREFILL_TOKEN_BUCKETS)
        self.e2e_request_latency = h("e2e_request_latency_seconds",
                                     "Histogram of e2e request latency in seconds.",
                                     REQUEST_BUCKETS)
        self.request_queue_time = h("request_queue_time_seconds", "Histogram of time spent "
                                    "in WAITING phase for request.", REQUEST_BUCKETS)
        self.request_inference_time = h("request_inference_time_seconds", "Histogram of "
                                        "time spent in RUNNING phase for request.",
                                        REQUEST_BUCKETS)
        self.request_prefill_time = h("request_prefill_time_seconds", "Histogram of time "
                                      "spent in PREFILL phase for request.", REQUEST_BUCKETS)
        self.request_decode_time = h("request_decode_time_seconds", "Histogram of time "
                                     "spent in DECODE phase for request.", REQUEST_BUCKETS)
        self.spec_decode_num_drafts = c("spec_decode_num_drafts",
                                        "Number of spec decoding drafts.")
        self.spec_decode_num_draft_tokens = c("spec_decode_num_draft_tokens",
                                              "Number of draft tokens.")
        self.spec_decode_num_accepted_tokens = c("spec_decode_num_accepted_tokens",
                                                 "Number of accepted tokens.")
        self._accepted_per_pos = Counter(
            self._name("spec_decode_num_accepted_tokens_per_pos"),
            "Accepted tokens per draft position.", [*self._labels, "position"],
            registry=self.registry)

        # -- kvserve's own ---------------------------------------------------------------
        self.engine_healthy = g("engine_healthy", "1 while the engine loop runs, 0 once it "
                                "died (the server then answers 503).")
        self.kernels_compiled = g("kernels_compiled", "1 when the native C kernels were "
                                  "built, 0 when the slower torch paths run instead (no C "
                                  "compiler, or the build failed: /health says why).")
        self.kv_cache_utilization_perc = g(
            "kv_cache_utilization_perc",
            "Share of handed-out KV slots that hold a token. 1 means 100 percent.")
        self.kv_cache_fragmentation_perc = g(
            "kv_cache_fragmentation_perc",
            "Share of KV slots lost to fragmentation: handed out but empty (internal) plus "
            "free but unusable for the next allocation (external). 1 means 100 percent.")
        self.kv_transfer_bytes = c("kv_transfer_bytes", "KV bytes moved between tiers, by "
                                   "kind.", kind=TRANSFER_KINDS)
        self.kv_transfer_seconds = c("kv_transfer_seconds", "Time spent moving KV between "
                                     "tiers, by kind.", kind=TRANSFER_KINDS)
        self.step_time_seconds = c("step_time_seconds", "Time of the profiled steps by part: "
                                   "linear layers, attention, other (one step in "
                                   "step_profile_interval is profiled).", part=STEP_PARTS)
        self.profiled_steps = c("profiled_steps", "Steps whose time was split by part.")
        self.iteration_decode_requests = h("iteration_decode_requests", "Requests computing "
                                           "one new token, per engine step.",
                                           BATCH_ROW_BUCKETS)
        self.iteration_prefill_tokens = h("iteration_prefill_tokens", "Prompt tokens "
                                          "computed per engine step.", ITERATION_TOKEN_BUCKETS)
        self.batch_lines = g("batch_lines", "Batch API lines of active batches, by state.",
                             state=("queued", "running"))
        self.batch_lines_finished = c("batch_lines_finished", "Batch API lines finished, by "
                                      "outcome.", outcome=("completed", "failed"))
        self.structured_output_requests = c("structured_output_requests", "Requests that "
                                            "decoded under a grammar (json_schema, regex, "
                                            "tool calls, ...).")

    # -- construction --------------------------------------------------------------------

    def _name(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    def _child(self, metric_cls, name: str, doc: str, /, **values: tuple[str, ...]):
        """A Gauge or Counter bound to the server's labels; with ``key=(values...)`` a dict
        of its children by that one extra label."""
        metric = metric_cls(self._name(name), doc, [*self._labels, *values],
                            registry=self.registry)
        if not values:
            return metric.labels(**self._labels)
        (key, options), = values.items()
        return {v: metric.labels(**self._labels, **{key: v}) for v in options}

    def _gauge(self, name: str, doc: str, /, **values: tuple[str, ...]):
        return self._child(Gauge, name, doc, **values)

    def _counter(self, name: str, doc: str, /, **values: tuple[str, ...]):
        return self._child(Counter, name, doc, **values)

    def _histogram(self, name: str, doc: str, buckets: list[float]):
        return Histogram(self._name(name), doc, list(self._labels), buckets=buckets,
                         registry=self.registry).labels(**self._labels)

    # -- use -----------------------------------------------------------------------------

    def accepted_at(self, position: int):
        return self._accepted_per_pos.labels(**self._labels, position=str(position))

    def publish_cache_config(self, info: dict[str, object]) -> None:
        """``cache_config_info``: the KV cache settings as labels of a gauge at 1 (vLLM's),
        set once the engine is loaded."""
        info = {**info, "engine": "0"}
        names = sorted(info)
        Gauge(self._name("cache_config_info"), "Information of the LLMEngine CacheConfig",
              names, registry=self.registry).labels(**{n: str(info[n]) for n in names}).set(1)

    def enable_lora_info(self, max_loras: int) -> None:
        """``lora_requests_info`` (vLLM's): a gauge whose labels name the adapters of the
        running and the waiting requests, set to the time they were seen (a reader takes
        the latest series)."""
        self.max_loras = max_loras
        self.lora_requests_info = Gauge(
            self._name("lora_requests_info"), "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=self.registry)

    def publish_loras(self, running: tuple[str, ...], waiting: tuple[str, ...]) -> None:
        if self.lora_requests_info is not None:
            self.lora_requests_info.labels(
                max_lora=str(self.max_loras), waiting_lora_adapters=",".join(waiting),
                running_lora_adapters=",".join(running)).set_to_current_time()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
