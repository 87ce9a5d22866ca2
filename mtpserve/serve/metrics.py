"""Prometheus metrics for the server, all named `mtpserve:*` (vLLM's names with our prefix).

Request metrics are observed on the engine thread from each step's outputs (ServerMetrics.on_outputs);
engine gauges and the cumulative engine counts (spec decode, preemptions, step errors) are read at scrape
time from the AsyncEngine's snapshots, so the scrape never calls into the engine. Every count is a Prometheus
counter, exposed with `_total` as vLLM's are (`mtpserve:spec_decode_num_drafts_total`, ...), so rate() works.
"""
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()   # no *_created samples (as vLLM)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class EngineCollector:
    """Gauges read from the AsyncEngine's last stats/spec-metrics snapshot."""

    def __init__(self, async_engine, model_name: str):
        self.async_engine, self.model_name = async_engine, model_name

    def _gauge(self, name: str, doc: str, value, family=GaugeMetricFamily):
        g = family(name, doc, labels=["model_name"])
        g.add_metric([self.model_name], float(value or 0))
        return g

    def _counter(self, name: str, doc: str, value):
        return self._gauge(name, doc, value, CounterMetricFamily)

    def collect(self):
        stats, spec = self.async_engine.stats, self.async_engine.spec_metrics
        yield self._gauge("mtpserve:num_requests_running", "Requests being run by the engine.",
                          stats.get("num_running"))
        yield self._gauge("mtpserve:num_requests_waiting", "Requests waiting to be scheduled.",
                          self.async_engine.num_waiting())
        yield self._gauge("mtpserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
                          stats.get("kv_usage"))
        yield self._gauge("mtpserve:kv_cache_free_blocks", "Free KV-cache blocks.", stats.get("num_free_blocks"))
        yield self._gauge("mtpserve:kv_cache_total_blocks", "KV-cache blocks in all.", stats.get("num_total_blocks"))
        ranks = stats.get("data_parallel_ranks") or []
        if ranks:   # each data-parallel engine core's load (what the front balances new requests on)
            for name, key, doc in (("running", "num_running", "Requests running on each data-parallel rank."),
                                   ("waiting", "num_waiting", "Requests waiting on each data-parallel rank."),
                                   ("kv_cache_usage_perc", "kv_usage", "KV-cache use of each data-parallel rank.")):
                g = GaugeMetricFamily(f"mtpserve:dp_rank_{name}", doc, labels=["model_name", "dp_rank"])
                for r in ranks:
                    g.add_metric([self.model_name, str(r["rank"])], float(r[key]))
                yield g
        yield self._gauge("mtpserve:kv_held_requests", "Prefilled requests whose KV waits to be pulled (disagg).",
                          stats.get("num_held_kv_requests"))
        yield self._counter("mtpserve:num_preemptions", "Requests preempted (KV blocks ran out).",
                            stats.get("num_preemptions"))
        yield self._counter("mtpserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            spec.get("prefix_cache_queries"))
        yield self._counter("mtpserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                            spec.get("prefix_cache_hits"))
        yield self._counter("mtpserve:engine_step_errors", "Engine steps that raised as a whole (their requests "
                            "failed).", self.async_engine.num_step_errors)
        yield self._counter("mtpserve:spec_decode_num_drafts", "Speculative steps (drafts proposed).",
                            spec.get("num_drafts"))
        yield self._counter("mtpserve:spec_decode_num_draft_tokens", "Draft tokens proposed.",
                            spec.get("num_draft_tokens"))
        yield self._counter("mtpserve:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                            spec.get("num_accepted_tokens"))
        g = CounterMetricFamily("mtpserve:spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted at each draft position.", labels=["model_name", "position"])
        for pos, n in enumerate(spec.get("accepted_per_position") or []):
            g.add_metric([self.model_name, str(pos)], float(n))
        yield g
        if spec.get("draft_steps_by_k") is not None:   # adaptive speculation: the k each step drafted
            g = CounterMetricFamily("mtpserve:spec_decode_draft_steps_by_k", "Steps that drafted k tokens "
                                    "(adaptive speculation).", labels=["model_name", "k"])
            for k, n in enumerate(spec["draft_steps_by_k"]):
                g.add_metric([self.model_name, str(k)], float(n))
            yield g
        yield self._gauge("mtpserve:spec_decode_acceptance_rate", "Accepted / proposed draft tokens.",
                          spec.get("acceptance_rate"))
        yield self._gauge("mtpserve:spec_decode_mean_acceptance_length",
                          "Tokens produced per speculative step (accepted + 1).",
                          spec.get("mean_acceptance_length"))


class TransferCollector:
    """Disaggregation: hand-offs this server served (prefill) or pulled (decode), read at scrape time."""

    def __init__(self, connector, model_name: str):
        self.connector, self.model_name = connector, model_name

    def collect(self):
        c = self.connector.counters()
        for name, key, doc in (
                ("kv_handoffs_sent", "sent", "Hand-offs pulled from this (prefill) server."),
                ("kv_handoff_bytes_sent", "sent_bytes", "Bytes of hand-offs sent."),
                ("kv_handoffs_parked", "parked", "Hand-offs waiting to be pulled (a gauge)."),
                ("kv_handoffs_pulled", "pulled", "Hand-offs this (decode) server pulled."),
                ("kv_handoff_kv_bytes_pulled", "pulled_kv_bytes", "Latent KV bytes pulled."),
                ("kv_handoff_pull_seconds", "pull_seconds", "Seconds spent pulling hand-offs.")):
            family = GaugeMetricFamily if key == "parked" else CounterMetricFamily
            g = family(f"mtpserve:{name}", doc, labels=["model_name"])
            g.add_metric([self.model_name], float(c[key]))
            yield g


class ServerMetrics:
    def __init__(self, async_engine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(async_engine, model_name))
        lbl = ["model_name"]
        r = self.registry
        self.request_success = Counter("mtpserve:request_success", "Finished completions, by finish reason.",
                                       lbl + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("mtpserve:prompt_tokens", "Prompt tokens of finished requests.", lbl,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("mtpserve:generation_tokens", "Generated tokens.", lbl,
                                         registry=r).labels(model_name)
        self.request_errors = Counter("mtpserve:request_errors", "Requests answered with an error, by status.",
                                      lbl + ["status"], registry=r)
        hist = lambda name, doc: Histogram(name, doc, lbl, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.ttft = hist("mtpserve:time_to_first_token_seconds", "Arrival to first output token.")
        self.itl = hist("mtpserve:inter_token_latency_seconds",
                        "Time between consecutive outputs of a request (one engine step; with speculation "
                        "one output may carry several tokens).")
        self.tpot = hist("mtpserve:request_time_per_output_token_seconds",
                         "Per request: (finish - first token) / (output tokens - 1).")
        self.e2e = hist("mtpserve:e2e_request_latency_seconds", "Arrival to finish.")
        self.model_name = model_name
        self._last = {}   # request_id -> (time of its last output, tokens so far); engine thread only

    def on_outputs(self, outputs, now: float) -> None:
        """Called on the engine thread with one step's RequestOutputs."""
        for out in outputs:
            num_tokens = sum(len(c.token_ids) for c in out.outputs)
            m = getattr(out, "metrics", None)
            prev = self._last.get(out.request_id)
            if prev is None:
                if num_tokens and m is not None and getattr(m, "arrival_time", None) is not None:
                    first = getattr(m, "first_token_time", None) or now
                    self.ttft.observe(max(first - m.arrival_time, 0.0))
            elif num_tokens > prev[1]:
                self.itl.observe(max(now - prev[0], 0.0))
            if num_tokens and (prev is None or num_tokens > prev[1]):
                self.generation_tokens.inc(num_tokens - (prev[1] if prev else 0))
                self._last[out.request_id] = (now, num_tokens)
            if out.finished:
                self._finish(out, m, now)

    def _finish(self, out, m, now: float) -> None:
        self._last.pop(out.request_id, None)
        self.prompt_tokens.inc(len(out.prompt_token_ids or []))
        for c in out.outputs:
            self.request_success.labels(self.model_name, str(c.finish_reason)).inc()
        if m is None or getattr(m, "arrival_time", None) is None:
            return
        end = getattr(m, "finished_time", None) or now
        self.e2e.observe(max(end - m.arrival_time, 0.0))
        first = getattr(m, "first_token_time", None)
        n = max((len(c.token_ids) for c in out.outputs), default=0)
        if first is not None and n > 1:
            self.tpot.observe(max(end - first, 0.0) / (n - 1))

    def on_abort(self, request_id: str) -> None:
        """Called on the engine thread when a running request is aborted (finish reason 'abort')."""
        self._last.pop(request_id, None)
        self.request_success.labels(self.model_name, "abort").inc()

    def count_error(self, status: int) -> None:
        self.request_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
