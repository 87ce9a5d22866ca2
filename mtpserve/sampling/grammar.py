"""Structured outputs: a grammar (JSON schema, any JSON object, regex, choice, EBNF) compiled by xgrammar, and
the token mask it allows at each position of a request.

A request's GrammarState follows whatever token sequence it is asked about: a verify step asks for the masks
after the output and after each draft prefix, so the matcher accepts the drafts one at a time and rolls back
to the shared prefix for the next question.
    output [o1, o2], drafts [d1, d2]:  masks after [o1 o2], [o1 o2 d1], [o1 o2 d1 d2]
A draft the grammar forbids ends the path: no mask after it (those positions come after a rejection and are
never used). Masks: True where the token is allowed (EOS once the grammar is complete).
"""
import json
import threading
from dataclasses import dataclass

import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's: exactly one of them. json: a JSON schema (dict or its text); json_object: any JSON object;
    regex; choice: the output is one of these strings; grammar: EBNF (GBNF)."""
    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: tuple | list | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of {', '.join(KINDS)} (got {given or 'none'})")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs: 'choice' must be a non-empty list of strings")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the compiled grammar is cached by."""
        kind = next(k for k in KINDS if getattr(self, k) not in (None, False))
        value = getattr(self, kind)
        if kind in ("json", "choice"):
            value = value if isinstance(value, str) else json.dumps(list(value) if kind == "choice" else value,
                                                                      sort_keys=True)
        return kind, "" if kind == "json_object" else value


class GrammarCompiler:
    """One per engine: xgrammar's compiler over the tokenizer's vocabulary (padded to the model's), its
    compiled grammars cached by (kind, text). Thread-safe: the server compiles on its parsing thread (a bad
    grammar gets its 400 there), the engine finds it cached."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        import xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self.cache, self.lock = {}, threading.Lock()

    def compile(self, spec: StructuredOutputsParams):
        key = spec.key
        with self.lock:
            if key in self.cache:
                return self.cache[key]
        kind, text = key
        try:
            if kind in ("json", "json_object"):   # (no free whitespace: a model cannot loop on spaces)
                schema = text if kind == "json" else '{"type": "object"}'
                compiled = self.compiler.compile_json_schema(schema, strict_mode=True, any_whitespace=False)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(text)
            elif kind == "choice":
                compiled = self.compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c) for c in json.loads(text)))
            else:
                compiled = self.compiler.compile_grammar(text)
        except Exception as e:   # xgrammar raises RuntimeError/ValueError with its parser's message
            raise ValueError(f"structured_outputs: the {kind} could not be compiled: "
                             f"{str(e).splitlines()[-1][:300]}") from None
        with self.lock:
            self.cache[key] = compiled
        return compiled


class GrammarState:
    """A request's matcher and the tokens it has accepted."""

    def __init__(self, compiled):
        import xgrammar
        self.vocab_size = compiled.tokenizer_info.vocab_size
        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.tokens: list[int] = []
        self.bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)

    def allowed_after(self, generated: list[int]) -> torch.Tensor | None:
        """[vocab] bool: the tokens the grammar allows after `generated`; None if `generated` leaves it
        (a forbidden draft) or the grammar has ended."""
        common = 0
        for a, b in zip(self.tokens, generated):
            if a != b:
                break
            common += 1
        if len(self.tokens) > common:
            self.matcher.rollback(len(self.tokens) - common)
            del self.tokens[common:]
        for token in generated[common:]:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                return None
            self.tokens.append(token)
        if self.matcher.is_terminated():
            return None
        self.matcher.fill_next_token_bitmask(self.bitmask)
        bits = self.bitmask[0]
        allowed = ((bits.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten().bool()
        return allowed[:self.vocab_size]


def compiler_for(model_config, tokenizer) -> GrammarCompiler:
    """This process's compiler: the front's engine and each worker rank make their own from the checkpoint's
    tokenizer (compiled grammars do not travel between processes; the same text compiles the same)."""
    from mtpserve.config import eos_token_ids
    if tokenizer is None:
        raise ValueError("structured_outputs: this model has no tokenizer")
    return GrammarCompiler(tokenizer, model_config.vocab_size, eos_token_ids(model_config, tokenizer))
