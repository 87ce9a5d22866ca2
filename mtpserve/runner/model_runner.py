"""One engine step on the model: the target forward, sampling or verification, then MTP drafting."""
import dataclasses
from collections import Counter

import torch

from mtpserve.config import SpeculativeConfig
from mtpserve.runner.batch import build_batch
from mtpserve.runner.graphs import GraphRunner
from mtpserve.sampling import logprobs, processors
from mtpserve.sampling.sampler import TARGET_NOISE, draw, request_probs, sample
from mtpserve.spec_decode import fused
from mtpserve.spec_decode.proposer import make_proposer, proposer_class
from mtpserve.spec_decode.verifier import Verifier
from mtpserve.step import FUSED, FUSED_SAMPLED, MAIN, Pass, Row, StepResult, flat_rows, fused_kv_reach


def num_drafter_caches(cfg, spec: SpeculativeConfig | None) -> int:
    cls = proposer_class(spec)
    return 0 if cls is None else cls.num_kv_caches(cfg, spec)


class ModelRunner:
    fuses_steps = True   # decode steps run as one function (spec_decode/fused.py); not under DP (dp_runner.py)
    splits_mixed_steps = True   # prompt chunks and decode rows as two forwards (execute); not under DP

    def __init__(self, model, num_blocks: int, block_size: int, spec: SpeculativeConfig | None,
                 device, kv_dtype: torch.dtype, seed: int = 0, graph_batch_sizes: list[int] | None = None,
                 max_span: int = 0, compile_in_background: bool = False, zeroed_kv: bool = True):
        """max_span: the most KV positions a request can reach (max_model_len plus a step's overshoot).
        compile_in_background: graphs are built by a compiler thread as steps first need them (runner/graphs.py).
        zeroed_kv=False: the KV cache left as allocated, its pages untouched (a compiler process's copy)."""
        cfg = model.config
        self.model, self.spec, self.device, self.block_size = model, spec, device, block_size
        # One more block than the manager hands out: slot -1 (padding) lands in its last row.
        allocate = torch.zeros if zeroed_kv else torch.empty
        self.kv_caches = [allocate(num_blocks + 1, block_size, cfg.kv_cache_dim, dtype=kv_dtype, device=device)
                          for _ in range(cfg.num_hidden_layers + num_drafter_caches(cfg, spec))]
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.main_caches = self.kv_caches[:cfg.num_hidden_layers]
        self.mtp_caches = self.kv_caches[cfg.num_hidden_layers:]
        self.graphs = None
        if graph_batch_sizes:
            self.graphs = GraphRunner(model, self.main_caches, self.mtp_caches, graph_batch_sizes, block_size,
                                      max_span, device, spec, background=compile_in_background)
        self.pass_counts = Counter()   # forwards run: "main", "mtp" (passes apart), "fused", "fused_sampled", dummies
        # one verify path for every drafter: only the proposer differs
        self.proposer = make_proposer(spec, model, self.forward, self.generator, device, self.graphs is not None)
        self.verifier = Verifier(spec, model, self.generator, device)
        # Decode steps run as one function (spec_decode/fused.py), in one process: its graph when built (graph
        # mode), else eagerly. With MTP for each k a step can verify and draft; without speculation k = 0 (the
        # target pass, the LM head and the sample in one graph).
        self.fuses = self.fuses_steps and (spec is None or (
            self.proposer is not None and self.proposer.fuses_with_verification and spec.fused_graph_step
            and spec.synthetic_acceptance is None and spec.scorer == "mqa"))
        self.max_positions = -(-max_span // block_size) * block_size   # (the block table's reach)
        self.fused_eagerly: dict = {}   # (Pass, q) -> the fused step function, run eagerly (no graph for it yet)

    def forward(self, which: Pass, rows: list[Row], prev_hidden: torch.Tensor | None = None,
                output_index: list[int] | None = None) -> torch.Tensor:
        """Runs the main model (MAIN) or an MTP layer (mtp_layer(j)) on rows: a graph when the rows are uniform
        and fit one, else eagerly. Returns hidden states of every token, or of `output_index` (MTP only)."""
        self.pass_counts[which.kind] += 1
        if self.graphs is not None and self.graphs.fits(which, rows, output_index):
            return self.graphs.run(which, rows, prev_hidden, output_index)
        return self._eager(which, rows, prev_hidden, output_index)

    def _eager(self, which: Pass, rows, prev_hidden, output_index):
        input_ids, positions, meta = build_batch(rows, self.block_size, self.device)
        if which.kind == "main":
            return self.model(input_ids, positions, meta, self.main_caches)
        index = None if output_index is None else torch.tensor(output_index, dtype=torch.long, device=self.device)
        return self.model.mtp_forward(which.layer, input_ids, positions, prev_hidden, meta,
                                      self.mtp_caches[which.layer], index)

    def warm_up_graphs(self, can_compile_later: bool = False) -> float:
        """Compiles/captures every graph now (start-up); returns the seconds it took. can_compile_later: a
        compiler thread may build graphs while steps run (one CPU process). There, MTP steps that fuse build only
        the fused step's graphs now; the model's passes apart (steps of requests with host processors, a step
        after a prompt or changing k) when a step first needs them, eager until then (docs/history.md)."""
        if self.graphs is None:
            return 0.0
        verified = self.spec.verified_draft_counts if self.spec is not None else [0]
        apart = [(MAIN, 1 + v) for v in verified] + (self.proposer.graph_shapes() if self.proposer else [])
        # (adaptive k: 0 too, plain decoding with the MTP layers' KV passes)
        fused_shapes = [(which, 1 + k) for k in verified for which in (FUSED, FUSED_SAMPLED)] if self.fuses else []
        later = apart if fused_shapes and can_compile_later else []
        self.graphs.warm_up(list(dict.fromkeys(fused_shapes + apart)), later)
        return self.graphs.compile_seconds

    def _fused_step(self, which: Pass, scheduled) -> list[StepResult]:
        k = len(scheduled[0].draft_token_ids)
        rows = [Row(s.req.all_token_ids[s.start:s.start + 1] + s.draft_token_ids, s.start, s.req.block_ids)
                for s in scheduled]
        self.pass_counts[str(which)] += 1
        sampling = None
        if which.sampled:
            sampling = fused.sampling_inputs(self.spec, [s.req for s in scheduled],
                                             [s.draft_token_ids for s in scheduled], self.model.config.vocab_size,
                                             self.generator, self.device)
        if self.graphs is not None and self.graphs.fused_ready(which, len(scheduled), k):
            outs, probs, hidden = self.graphs.run_fused(which, rows, sampling)
        else:
            outs, probs, hidden = self._fused_eagerly(which, rows, sampling)
        new_tokens = [out[:out[1 + k] + 1] for out in outs]
        scores = logprobs.read(self.model, scheduled, hidden, [i * (1 + k) for i in range(len(outs))], new_tokens)
        return [StepResult(tokens, num_drafts=k, num_accepted=len(tokens) - 1, next_drafts=out[k + 2:] or None,
                           next_draft_probs=None if probs is None or not k else probs[i], **scored)
                for i, (out, tokens, scored) in enumerate(zip(outs, new_tokens, scores))]

    def _fused_eagerly(self, which: Pass, rows: list[Row], sampling) -> tuple:
        """The fused step as it is, fed fresh tensors (eager mode; graph mode until its graph is built)."""
        q = len(rows[0].token_ids)
        if (which, q) not in self.fused_eagerly:
            self.fused_eagerly[which, q] = fused.fused_step(self.model, self.main_caches, self.mtp_caches,
                                                            self.block_size, self.spec, which, q, static=False)
        bucket = -(-fused_kv_reach(max(r.start for r in rows), q - 1) // self.block_size)
        ids, positions, slots, seq_lens, tables = flat_rows(rows, q, bucket, self.block_size)
        tensor = lambda v: torch.tensor(v, dtype=torch.long, device=self.device)  # noqa: E731
        outs, probs, hidden = self.fused_eagerly[which, q](
            tensor(ids), tensor(positions), tensor(seq_lens), tensor(slots), tensor(tables).view(len(rows), -1),
            *(sampling or []))
        return outs.tolist(), probs, hidden

    @torch.inference_mode()
    def execute(self, scheduled: list) -> list[StepResult]:   # ScheduledRequests (step.py)
        """A step with prompt chunks beside decode rows runs them as two forwards: a decode row's bits never depend
        on a prompt's rows, and the decode rows can take their graph. [a: t5 d6 d7] [b: 512 prompt tokens] ->
        forward [t5 d6 d7], then forward [b's 512 tokens]."""
        decodes = [s.decodes(len(s.draft_token_ids)) for s in scheduled]
        if not self.splits_mixed_steps or all(decodes) or not any(decodes):
            return self._execute(scheduled)
        decoding = [i for i, d in enumerate(decodes) if d]
        rest = [i for i, d in enumerate(decodes) if not d]
        results = dict(zip(decoding + rest, self._execute([scheduled[i] for i in decoding])
                           + self._execute([scheduled[i] for i in rest])))
        return [results[i] for i in range(len(scheduled))]

    def _execute(self, scheduled: list) -> list[StepResult]:
        fused_pass = fused.fused_graph(self, scheduled)
        if fused_pass is not None:
            return self._fused_step(fused_pass, scheduled)
        rows, offsets = [], [0]   # offsets[i]: where request i's tokens start in the flat batch
        pad_to = self._graph_query_len(scheduled)
        for s in scheduled:
            tokens = s.req.all_token_ids[s.start:s.start + s.num_new_tokens] + s.draft_token_ids
            if self.spec is not None and self.spec.scorer == "batch_expansion" and s.draft_token_ids:
                rows += [Row([t], s.start + j, s.req.block_ids) for j, t in enumerate(tokens)]
            elif len(tokens) < pad_to:   # padding tokens: computed, never kept, never read
                rows.append(Row(tokens + tokens[-1:] * (pad_to - len(tokens)), s.start, s.req.block_ids, len(tokens)))
            else:
                rows.append(Row(tokens, s.start, s.req.block_ids))
            offsets.append(offsets[-1] + max(len(tokens), pad_to))
        hidden = self.forward(MAIN, rows)
        # each stage reads what the ones before returned: the emitted tokens, then their logprobs, the next drafts
        emitted = (self._sample([i for i, s in enumerate(scheduled) if s.samples and not s.draft_token_ids],
                                scheduled, hidden, offsets)
                   | self.verifier([i for i, s in enumerate(scheduled) if s.samples and s.draft_token_ids],
                                   scheduled, hidden, offsets))
        results = [emitted.get(i, StepResult([])) for i in range(len(scheduled))]
        new_tokens = [r.new_token_ids for r in results]
        scores = logprobs.read(self.model, scheduled, hidden, offsets, new_tokens)
        drafts = (self.proposer.propose(scheduled, hidden, offsets, new_tokens) if self.proposer is not None
                  else [(None, None)] * len(scheduled))
        return [dataclasses.replace(r, next_drafts=d, next_draft_probs=p, **scored)
                for r, (d, p), scored in zip(results, drafts, scores)]

    def _graph_query_len(self, scheduled) -> int:
        """In graph mode a decode batch mixing requests without drafts (n-gram found none; a hand-off's first
        step, disagg scheme 2) with ones verifying k drafts is padded to 1+k tokens each, so that its target
        pass runs as a graph: rows [t5] and [t9 d10 d11] run as [t5 t5 t5] (2 padding tokens, no KV kept) and
        [t9 d10 d11]. 0: no padding."""
        if self.graphs is None or self.proposer is None or self.spec.scorer != "mqa":
            return 0
        counts = {len(s.draft_token_ids) for s in scheduled}
        if (len(counts) == 1 or self.graphs.padded_size(len(scheduled)) is None
                or not all(s.decodes(len(s.draft_token_ids)) for s in scheduled)):
            return 0
        return 1 + max(counts)

    def _sample(self, idx, scheduled, hidden, offsets) -> dict:
        """Samples one token for scheduled[i], i in idx -> {i: StepResult([token]), with the hidden state it was
        sampled from for a request that holds its KV (a prefill server ships it, disagg scheme 2)}."""
        if not idx:
            return {}
        reqs = [scheduled[i].req for i in idx]
        last_hidden = hidden[[offsets[i] + scheduled[i].num_query_tokens - 1 for i in idx]]
        logits = processors.process(self.model.compute_logits(last_hidden),
                                    [h for r in reqs for h in processors.histories(r, [[]])])
        if all(r.params.greedy for r in reqs):   # no distribution needed: the argmax is the sample
            tokens = logits.argmax(-1)
        else:
            probs = request_probs(logits, reqs, None, self.device)
            noise = draw([r.seed for r in reqs], [r.num_tokens for r in reqs], 1, probs.shape[-1], "exponential",
                         TARGET_NOISE, self.generator, self.device, [r.params.greedy for r in reqs])
            tokens = sample(probs, noise[:, 0])
        return {i: StepResult([token], last_hidden=last_hidden[j].clone() if scheduled[i].req.hold_kv else None)
                for j, (i, token) in enumerate(zip(idx, tokens.tolist()))}
