"""tool_choice "auto" end to end: a DeepSeek-V3-format test checkpoint (its tokenizer has DeepSeek's tool-call
tokens, its chat template renders calls with them) trained for a few seconds to answer a weather question with a
call and a greeting with text; the server reads the calls with --tool-call-parser deepseek_v3, whole and streamed
(the streamed pieces add up to the whole), the same with MTP on and off. The readers on partial text too."""
import asyncio
import json
import os

import httpx
import openai
import pytest
import torch

from mtpserve.serve.tool_text import read_calls

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% if m.get('tool_calls') %}"
            "<｜tool▁calls▁begin｜>{% for c in m['tool_calls'] %}<｜tool▁call▁begin｜>function<｜tool▁sep｜>"
            "{{ c['function']['name'] }}\n```json\n{{ c['function']['arguments'] }}\n```<｜tool▁call▁end｜>"
            "{% endfor %}<｜tool▁calls▁end｜>{% else %}{{ m['content'] }}{% endif %}\n"
            "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def call_text(city: str) -> str:
    return f'{BEGIN}{CALL}function{SEP}get_weather\n```json\n{{"city": "{city}"}}\n```{CALL_END}{END}'


ANSWERS = {"weather in Paris?": call_text("Paris"), "weather in Oslo?": call_text("Oslo"), "hello": "Hi there."}


def write_deepseek_format_checkpoint(path: str) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from mtpserve.model.checkpoint import save_checkpoint, tiny_config
    from mtpserve.config import ModelConfig
    from mtpserve.model.deepseek_v3 import DeepseekV3ForCausalLM
    from mtpserve.train.loss import mtp_objective
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(ANSWERS) + list(ANSWERS.values()), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>", "<bos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.add_tokens([AddedToken(t, special=False) for t in (BEGIN, END, CALL, CALL_END, SEP)])   # (as DeepSeek-V3's)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                   "clean_up_tokenization_spaces": False, "chat_template": TEMPLATE}, f)
    hf = tiny_config(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     first_k_dense_replace=1, n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=1,
                     num_nextn_predict_layers=1, bos_token_id=1, eos_token_id=0)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(ModelConfig.from_dict(hf))
    model.init_weights(0)
    seqs = [tok.encode(f"<|user|>{q}\n<|assistant|>{a}").ids + [0] for q, a in ANSWERS.items()]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])   # (eos after the end: harmless to learn)
    steps = 200
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # (the rate decays to 0: at a constant 1e-2 the loss could jump back up in the last steps, and whether it did
    # depended on the rounding of the kernels the CPU picked)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / steps)
    for _ in range(steps):
        loss = mtp_objective(model, ids, 1, mtp_lambda=0.3).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        decay.step()
    return save_checkpoint(model, path, dtype=torch.float32, hf_config=hf)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_deepseek_format_checkpoint(str(tmp_path_factory.mktemp("deepseek_format")))


def ask(ckpt: str, spec: dict | None, requests: list[dict]) -> list:
    """Each request through the in-process server (tool parser deepseek_v3) with the openai client."""
    from mtpserve.engine.async_engine import AsyncEngine
    from mtpserve.engine.engine import LLMEngine
    from mtpserve.serve.openai_api import build_app

    async def main():
        engine = AsyncEngine(LLMEngine.from_kwargs(model=ckpt, speculative_config=spec, max_model_len=256,
                                                   num_kv_blocks=64, enforce_eager=True))
        app = build_app(engine, "ds", None, 256, tool_parser="deepseek_v3")
        try:
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=http, max_retries=0)
            out = []
            for r in requests:
                reply = await client.chat.completions.create(model="ds", max_tokens=60, temperature=0, **r)
                out.append([c async for c in reply] if r.get("stream") else reply)
            return out
        finally:
            engine.shutdown()
    return asyncio.run(main())


def test_auto_tool_calls_in_deepseek_format_whole_and_streamed_with_and_without_mtp(ckpt):
    paris = {"messages": [{"role": "user", "content": "weather in Paris?"}], "tools": [WEATHER]}
    hello = {"messages": [{"role": "user", "content": "hello"}], "tools": [WEATHER]}
    seen = []
    for spec in (None, {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}):
        whole, text, streamed = ask(ckpt, spec, [paris, hello, paris | {"stream": True}])
        msg = whole.choices[0].message
        assert whole.choices[0].finish_reason == "tool_calls" and msg.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
            ("get_weather", {"city": "Paris"})]
        assert text.choices[0].message.content == "Hi there." and not text.choices[0].message.tool_calls
        deltas = [d for chunk in streamed if chunk.choices for d in chunk.choices[0].delta.tool_calls or []]
        assert deltas[0].id and deltas[0].function.name == "get_weather" and len(deltas) > 2   # (pieces)
        assert "".join(d.function.arguments or "" for d in deltas) == msg.tool_calls[0].function.arguments
        assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "tool_calls"
        assert not any(c.choices[0].delta.content for c in streamed if c.choices)
        seen.append((msg.tool_calls[0].function.arguments, text.choices[0].message.content))
    assert seen[0] == seen[1]   # speculation changes nothing


@pytest.mark.parametrize("choice, text", [
    ("required", '[{"name": "f", "parameters": {"a": [1, {"b": "}]"}]}}, {"name": "g", "parameters": {}}]'),
    ("auto", "Sure." + call_text("Paris") + "<｜end▁of▁sentence｜>"),
    ("named", '{"city": "Paris", "n": 3}')])
def test_readers_grow_monotonically_and_end_where_the_whole_text_does(choice, text):
    """Every prefix of the text reads as a prefix of the whole read (content and each call's arguments): a
    stream never takes back what it sent."""
    whole = read_calls(choice, "f", text, finished=True)
    assert whole.complete and whole.calls
    last = read_calls(choice, "f", "", finished=False)
    for n in range(1, len(text) + 1):
        now = read_calls(choice, "f", text[:n], finished=False)
        assert now.content.startswith(last.content) and whole.content.startswith(now.content)
        assert len(now.calls) >= len(last.calls)
        for (name, args), (whole_name, whole_args) in zip(now.calls, whole.calls):
            assert name == whole_name and whole_args.startswith(args)
        for (_, args), (_, before) in zip(now.calls, last.calls):
            assert args.startswith(before)
        last = now
    assert read_calls("auto", None, "no calls <｜tool", finished=False).content == "no calls "


def test_the_stop_token_is_kept_out_of_the_text_unless_asked(ckpt):
    """EOS (or a stop id) ends the text without its own text, special tokens shown or not; include_stop_str_in_output
    keeps it (vLLM's rule)."""
    from mtpserve import LLM, SamplingParams
    llm = LLM(ckpt, max_model_len=256, num_kv_blocks=32, enforce_eager=True)
    prompt = "<|user|>hello\n<|assistant|>"
    texts = [llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, skip_special_tokens=False, **kw),
                          use_tqdm=False)[0].outputs[0] for kw in ({}, {"include_stop_str_in_output": True})]
    assert texts[0].text == "Hi there." and texts[0].finish_reason == "stop" and texts[0].token_ids[-1] == 0
    assert texts[1].text == "Hi there.<eos>"
