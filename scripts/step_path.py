"""Counts what one MTP decode step passes through: the mtpserve files and functions LLMEngine.step reaches, and
the branches in them (`if`s, ternaries and comprehension `if`s; a nested function counts once, if reached).

    python scripts/step_path.py [--graph-mode] [--k 1] [--fixed] [--without-model]

--without-model leaves out mtpserve/model/ (the forward itself: layers, attention, MoE), as a count of an
engine's step loop would (nano-vllm's 3 files are its engine, scheduler and runner).
"""
import argparse
import ast
import sys
from pathlib import Path

import mtpserve
from mtpserve import LLM, SamplingParams

ROOT = Path(mtpserve.__file__).parent


def branches(node: ast.AST) -> int:
    count = 0
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        count += isinstance(child, (ast.If, ast.IfExp)) + (len(child.ifs) if isinstance(child, ast.comprehension) else 0)
        count += branches(child)
    return count


def functions_by_line(path: str) -> dict[int, ast.AST]:
    tree = ast.parse(Path(path).read_text())
    return {n.lineno: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def trace_step(llm: LLM) -> set:
    reached = set()

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(str(ROOT)):
            reached.add((code.co_filename, code.co_firstlineno, code.co_name))
    sys.setprofile(profile)
    try:
        llm.engine.step()
    finally:
        sys.setprofile(None)
    return reached


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--graph-mode", action="store_true")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--fixed", action="store_true", help="speculative_config adaptive: false")
    ap.add_argument("--without-model", action="store_true", help="leave out mtpserve/model/")
    args = ap.parse_args()
    spec = {"method": "mtp", "num_speculative_tokens": args.k, "adaptive": not args.fixed}
    graphs = dict(enforce_eager=False, graph_batch_sizes=[2]) if args.graph_mode else dict(enforce_eager=True)
    llm = LLM(None, speculative_config=spec, max_num_seqs=2, **graphs)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i, prompt in enumerate(["def fib(n):", "The capital of"]):
        llm.engine.add_request(str(i), prompt, None, params)
    for _ in range(4):   # prefill, then decode steps until the batch is steady
        llm.engine.step()
    reached = trace_step(llm)
    if args.without_model:
        reached = {r for r in reached if not r[0].startswith(str(ROOT / "model"))}
    by_file: dict[str, int] = {}
    for filename, line, name in sorted(reached):
        node = functions_by_line(filename).get(line)
        n = branches(node) if node is not None else 0
        rel = str(Path(filename).relative_to(ROOT.parent))
        by_file[rel] = by_file.get(rel, 0) + n
        print(f"{rel}:{line} {name}: {n}")
    print(f"\n{len(by_file)} files, {len(reached)} functions, {sum(by_file.values())} branches")
    for rel, n in sorted(by_file.items(), key=lambda x: -x[1]):
        print(f"  {n:4d}  {rel}")


if __name__ == "__main__":
    main()
