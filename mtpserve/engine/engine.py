"""The engine loop: schedule -> execute -> update (DESIGN.md section 2)."""
import logging
import os
import time

import torch

from mtpserve.config import EngineConfig, ModelConfig, SpeculativeConfig
from mtpserve.engine.detokenizer import detokenize_incrementally
from mtpserve.engine.kv_cache import BlockManager
from mtpserve.engine.request import CompletionOutput, Request, RequestOutput, RequestStatus
from mtpserve.engine.scheduler import Scheduler
from mtpserve.model.loader import load_model
from mtpserve.runner.model_runner import ModelRunner, num_mtp_caches
from mtpserve.sampling_params import SamplingParams
from mtpserve.spec.draft_vocab import load_draft_vocab
from mtpserve.spec.metrics import SpecDecodeMetrics

logger = logging.getLogger("mtpserve")


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dtype not in names:
        raise ValueError(f"dtype = {dtype!r}: must be one of 'auto', {sorted(names)}")
    return dev, names[dtype]


def load_tokenizer(path: str):
    if not os.path.isfile(os.path.join(path, "tokenizer.json")) and not os.path.isfile(
            os.path.join(path, "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        from mtpserve import default_model_path
        self.config = cfg
        path = cfg.model or default_model_path()
        self.model_config = ModelConfig.from_pretrained(path)
        spec = cfg.speculative
        if spec is not None and spec.method == "mtp" and self.model_config.num_nextn_predict_layers == 0:
            raise ValueError("speculative_config: method 'mtp' needs a checkpoint with MTP layers "
                             "(num_nextn_predict_layers = 0 in its config.json)")
        self.device, self.dtype = resolve_device_dtype(cfg.device, cfg.dtype)
        self.model = load_model(path, self.dtype, self.device, self.model_config).eval().fuse_for_inference()
        if spec is not None and spec.draft_vocab_size is not None:
            ids, coverage = load_draft_vocab(path, spec.draft_vocab_size, self.model_config.vocab_size)
            self.model.set_draft_vocab(ids.to(self.device))
            logger.info("draft vocabulary: the %d most frequent of %d tokens (%.1f%% of the counted tokens)",
                        len(ids), self.model_config.vocab_size, 100 * coverage)
        self.tokenizer = None if cfg.skip_tokenizer_init else load_tokenizer(path)
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(cfg.max_model_len or limit, limit)
        if cfg.max_model_len is not None and cfg.max_model_len > limit:
            raise ValueError(f"max_model_len = {cfg.max_model_len}: above the model's max_position_embeddings {limit}")
        k = spec.num_speculative_tokens if spec else 0
        if cfg.max_num_batched_tokens < 1 + k:
            raise ValueError(f"max_num_batched_tokens = {cfg.max_num_batched_tokens}: must be at least "
                             f"1 + num_speculative_tokens = {1 + k}")
        # MTP passes 1..k-1 write up to k-1 slots past the verified ones (n-gram drafting writes none)
        self.num_lookahead_slots = k if spec is not None and spec.method == "mtp" else 0
        # slots past the last token a step may need: the pending token, k drafts and the lookahead
        self.max_step_overshoot = k + 1 + self.num_lookahead_slots
        num_blocks = cfg.num_kv_blocks or self._kv_blocks_from_memory()
        self.block_manager = BlockManager(num_blocks, cfg.block_size)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   self.num_lookahead_slots)
        eager = cfg.enforce_eager if cfg.enforce_eager is not None else self.device.type != "cuda"
        self.use_graphs = not eager
        self.runner = ModelRunner(self.model, num_blocks, cfg.block_size, spec, self.device, self.dtype, cfg.seed,
                                  cfg.graph_batch_sizes if self.use_graphs else None,
                                  self.max_model_len + self.max_step_overshoot)
        self.graph_warmup_seconds = self.runner.warm_up_graphs()
        if self.use_graphs:
            from torch._inductor.runtime.cache_dir_utils import cache_dir
            logger.info("graph mode: %d graphs (batch sizes %s) built in %.1fs; compile cache %s",
                        len(self.runner.graphs.graphs), cfg.graph_batch_sizes, self.graph_warmup_seconds, cache_dir())
        self.spec_metrics = SpecDecodeMetrics(k) if spec else None
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.requests: dict[str, Request] = {}
        self.children: dict[str, list[Request]] = {}

    @classmethod
    def from_kwargs(cls, model: str | None = None, speculative_config: dict | None = None, **kwargs) -> "LLMEngine":
        return cls(EngineConfig(model=model, speculative=SpeculativeConfig.from_dict(speculative_config), **kwargs))

    def _kv_blocks_from_memory(self) -> int:
        mc, cfg = self.model_config, self.config
        layers = mc.num_hidden_layers + num_mtp_caches(mc, cfg.speculative)
        bytes_per_block = layers * cfg.block_size * mc.kv_cache_dim * torch.finfo(self.dtype).bits // 8
        if self.device.type == "cuda":
            budget = torch.cuda.mem_get_info(self.device)[0] * cfg.kv_cache_memory_fraction
        else:
            budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * cfg.kv_cache_memory_fraction
        per_seq = -(-(self.max_model_len + self.max_step_overshoot) // cfg.block_size)
        return max(per_seq, min(int(budget // bytes_per_block), per_seq * cfg.max_num_seqs))

    # ---- requests -------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                    params: SamplingParams) -> None:
        if request_id in self.children:
            raise ValueError(f"request_id {request_id!r} is already in use")
        token_ids = self._prompt_tokens(prompt, prompt_token_ids)
        room = self.max_model_len - len(token_ids)
        if room <= 0:
            raise ValueError(f"prompt: {len(token_ids)} tokens, at or over max_model_len = {self.max_model_len}")
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"max_tokens = {params.max_tokens}: prompt ({len(token_ids)} tokens) + max_tokens "
                             f"exceeds max_model_len = {self.max_model_len}")
        slots = len(token_ids) + (params.max_tokens or room) + self.max_step_overshoot
        if -(-slots // self.config.block_size) > self.block_manager.num_blocks:
            raise ValueError(f"max_tokens: prompt + max_tokens ({slots} KV slots with lookahead) would not fit in "
                             f"the KV cache ({self.block_manager.num_blocks} blocks of {self.config.block_size})")
        children = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(params.seed + i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(child_id, prompt, list(token_ids), params, params.max_tokens or room, gen, i, request_id)
            children.append(req)
            self.requests[child_id] = req
            self.scheduler.add(req)
        self.children[request_id] = children

    def _prompt_tokens(self, prompt, prompt_token_ids) -> list[int]:
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("prompt: give a prompt or prompt_token_ids")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt: empty prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: ids {bad[:5]} outside the vocabulary [0, {vocab})")
        return list(prompt_token_ids)

    def abort_request(self, request_id: str) -> None:
        for req in self.children.get(request_id, []):
            if not req.is_finished:
                self.scheduler.finish(req, "abort")
        self._forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        now = time.monotonic()
        for s in scheduled:
            s.req.metrics.first_scheduled_time = s.req.metrics.first_scheduled_time or now
        results = self.runner.execute(scheduled)
        now = time.monotonic()
        progressed = []
        for s, r in zip(scheduled, results):
            req = s.req
            if not s.samples:
                req.num_computed_tokens += s.num_new_tokens
                continue
            req.num_computed_tokens = req.num_tokens + len(r.new_token_ids) - 1
            if r.num_drafts and self.spec_metrics is not None:
                self.spec_metrics.record(r.num_drafts, r.num_accepted)
            self._append_tokens(req, r.new_token_ids)
            req.metrics.first_token_time = req.metrics.first_token_time or now
            req.metrics.last_token_time = now
            req.draft_token_ids = r.next_drafts or []
            req.draft_probs = r.next_draft_probs
            if req.is_finished:
                req.metrics.finished_time = now
            if req.parent_id not in progressed:
                progressed.append(req.parent_id)
        if self.spec_metrics is not None:
            self.spec_metrics.maybe_log()
        outputs = [self._output(pid) for pid in progressed]
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)
        return outputs

    def _append_tokens(self, req: Request, tokens: list[int]) -> None:
        """Appends accepted tokens one at a time, stopping at EOS, stop ids, stop strings or max_tokens."""
        p = req.params
        for t in tokens:
            req.output_token_ids.append(t)
            new_text = detokenize_incrementally(self.tokenizer, req) if self.tokenizer is not None else ""
            if not p.ignore_eos and t in self.eos_token_ids:
                return self.scheduler.finish(req, "stop")
            if t in p.stop_token_ids:
                req.stop_reason = t
                return self.scheduler.finish(req, "stop")
            if new_text and p.stop and self._hit_stop_string(req, len(new_text)):
                return self.scheduler.finish(req, "stop")
            if len(req.output_token_ids) >= req.max_tokens:
                return self.scheduler.finish(req, "length")

    def _hit_stop_string(self, req: Request, new_len: int) -> bool:
        longest = max(len(s) for s in req.params.stop)
        search_from = max(0, len(req.text) - new_len - longest + 1)
        hits = [(req.text.find(s, search_from), s) for s in req.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        req.text, req.stop_reason = req.text[:index], stop
        return True

    def _output(self, parent_id: str) -> RequestOutput:
        kids = self.children[parent_id]
        outs = [CompletionOutput(r.index, r.text, list(r.output_token_ids), r.finish_reason, r.stop_reason)
                for r in kids]
        return RequestOutput(parent_id, kids[0].prompt, kids[0].prompt_token_ids, outs,
                             all(r.is_finished for r in kids), kids[0].metrics)

    def _forget(self, parent_id: str) -> None:
        for req in self.children.pop(parent_id, []):
            self.requests.pop(req.request_id, None)

    # ---- introspection --------------------------------------------------------------------------------
    def get_metrics(self) -> dict:
        return self.spec_metrics.as_dict() if self.spec_metrics else SpecDecodeMetrics(0).as_dict()

    def get_stats(self) -> dict:
        bm = self.block_manager
        return dict(num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                    kv_usage=bm.usage, num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks)
