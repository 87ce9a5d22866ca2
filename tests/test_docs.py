"""The README and docs/: every relative link points at a file that exists."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_relative_links_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken, checked = [], 0
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue   # (web addresses, anchors)
            checked += 1
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert checked >= 10 and not broken, broken


def test_configuration_reference_matches_the_code():
    """docs/configuration.md is what `python -m mtpserve.config_doc` writes from the flags and config dataclasses:
    a flag or key added, removed or redescribed without regenerating the page fails here."""
    from mtpserve.config_doc import render
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == render(), "stale: run `python -m mtpserve.config_doc > docs/configuration.md`"
    for name in ("--speculative-config", "--quantization", "--kv-transfer-config", "num_speculative_tokens",
                 "mtp_handoff", "enable_prefix_caching"):
        assert f"`{name}`" in page


def test_every_flag_has_a_help_line():
    import argparse
    from mtpserve.serve.server import add_serve_args
    parser = add_serve_args(argparse.ArgumentParser())
    missing = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert not missing, missing


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_quick_start_runs_as_written():
    """The quick start's first command (after its pip install), with a small --max-tokens, on the shipped model;
    then the offline example as it is written."""
    import shutil
    import subprocess
    import sys
    command = _blocks("bash")[0].splitlines()[0].split("&&", 1)[1].strip()
    assert command.startswith("mtpserve generate")
    exe = shutil.which("mtpserve") or f"{sys.executable} -m mtpserve.cli"
    out = subprocess.run(command.replace("mtpserve", exe, 1) + " --max-tokens 8", shell=True, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "accept" in out.stdout.lower()
    check = '\nassert outs[0].outputs[0].logprobs and llm.get_metrics()["num_drafts"] > 0\n'
    out = subprocess.run([sys.executable, "-c", _blocks("python")[0] + check], capture_output=True, text=True,
                         timeout=600)   # (a process of its own: torch's threads as a user's, not the tests')
    assert out.returncode == 0, out.stderr[-2000:]


def test_gpu_check_says_there_is_no_cuda_device_and_exits_0():
    import shutil
    import subprocess
    if shutil.which("nvidia-smi"):
        pytest.skip("a GPU machine: the script runs the CUDA checks themselves")
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "no CUDA device" in out.stdout
