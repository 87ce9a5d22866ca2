"""The offline API: LLM(...).generate(prompts, SamplingParams(...))."""
import itertools

from tqdm import tqdm

from mtpserve.engine.engine import LLMEngine
from mtpserve.request import RequestOutput
from mtpserve.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, speculative_config: dict | None = None,
                 enforce_eager: bool | None = None, max_num_seqs: int = 64, max_model_len: int | None = None,
                 dtype: str = "auto", seed: int = 0, **engine_kwargs):
        self.engine = LLMEngine.from_kwargs(model=model, speculative_config=speculative_config,
                                            enforce_eager=enforce_eager, max_num_seqs=max_num_seqs,
                                            max_model_len=max_model_len, dtype=dtype, seed=seed, **engine_kwargs)
        self.engine.calibrate()
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_metrics(self) -> dict:
        return self.engine.get_metrics()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def generate(self, prompts: str | list[str] | None = None, sampling_params=None,
                 prompt_token_ids: list[list[int]] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs all prompts to completion; outputs come back in the order of the prompts. If anything fails
        (a bad prompt: ValueError), none of this call's requests stays queued; other callers' requests do."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if prompts is not None:   # strings, or vLLM-style {"prompt": ...} / {"prompt_token_ids": [...]} dicts
            items = [(p.get("prompt"), p.get("prompt_token_ids")) if isinstance(p, dict) else (p, None) for p in prompts]
        else:
            items = [(None, t) for t in prompt_token_ids or []]
        if not items:
            raise ValueError("prompts: give prompts or prompt_token_ids")
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(items)
        if len(params) != len(items):
            raise ValueError(f"sampling_params: {len(params)} given for {len(items)} prompts")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("sampling_params: expected SamplingParams (or a list of them, one per prompt)")
        ids = [str(next(self._ids)) for _ in items]
        done: dict[str, RequestOutput] = {}
        if not self.engine.has_unfinished_requests():
            self.engine.idle()
        try:
            for rid, (prompt, tokens), p in zip(ids, items, params):
                self.engine.add_request(rid, prompt, tokens, p)
            bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
            wanted = set(ids)
            while len(done) < len(ids):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"engine stopped with {len(ids) - len(done)} requests unfinished")
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
            bar.close()
        except BaseException:
            for rid in ids:   # nothing of this call stays queued, whatever went wrong
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        return [done[i] for i in ids]
