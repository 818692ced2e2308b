"""The repository keeps its promises: CI runs exactly the README's test command."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    quick_start = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(?:sh|bash)\n(.+?)\n```", quick_start)


def test_readme_has_the_two_commands_and_ci_runs_the_test_one_verbatim():
    demo, tests = readme_commands()
    assert demo.endswith("featcache demo")
    assert "pytest" in tests
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines


def test_constraints_pin_the_torch_pair():
    pins = (REPO / "constraints.txt").read_text().split()
    assert "torch==2.13.0" in pins and "torchvision==0.28.0" in pins


def test_constraints_pin_the_zoo_extras():
    pins = (REPO / "constraints.txt").read_text().split()
    for package in ("timm", "transformers", "open_clip_torch"):
        assert any(pin.startswith(f"{package}==") for pin in pins), package


def test_every_shipped_config_loads():
    from featcache.config.spec import load_config

    configs = sorted((REPO / "configs").glob("*.yaml"))
    assert len(configs) >= 6
    for path in configs:
        assert load_config(path).layers, path.name


def test_zoo_configs_select_their_layers_on_the_architecture():
    """The layer selectors of the timm and open_clip configs resolve on random weights of
    the same architectures (the pretrained weights need a download)."""
    import dataclasses

    from featcache.capture.selectors import resolve_taps
    from featcache.config.spec import load_config
    from featcache.models import build_backbone

    expected = {
        "convnext_tiny_timm.yaml": ["stages.2", "stages.3", "head.pre_logits"],
        "clip_vit_b32.yaml": ["embedding", "transformer.resblocks.11"],
    }
    for name, keys in expected.items():
        spec = load_config(REPO / "configs" / name)
        name_only = spec.model.name.split(".")[0] if name.startswith("convnext") else None
        model = dataclasses.replace(spec.model, weights=None, name=name_only or spec.model.name)
        backbone = build_backbone(model, spec.preprocess)
        assert [tap.key for tap in resolve_taps(backbone.model, spec.layers)] == keys


def test_text_config_selects_its_layers_on_a_minilm_shaped_bert():
    """configs/minilm_text.yaml's selectors resolve on a random BERT of MiniLM-L6's shape."""
    import transformers

    from featcache.capture.selectors import resolve_taps
    from featcache.config.spec import load_config

    spec = load_config(REPO / "configs" / "minilm_text.yaml")
    assert spec.data.inputs == "text"
    config = transformers.BertConfig(
        hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=64
    )
    model = transformers.BertModel(config)
    assert [tap.key for tap in resolve_taps(model, spec.layers)] == ["sentence", "tokens"]


def test_ci_fails_when_any_step_of_the_test_command_fails(tmp_path):
    """Under ``set -e``, bash goes on after a failure inside an ``&&`` list: an install
    that fails must still fail CI, even when the checks after it would pass."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(REPO / ".ci" / "run", repo / ".ci" / "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A python3 whose venv holds a python that fails to install, and lint tools that pass.
    fake = bin_dir / "python3"
    fake.write_text(
        "#!/bin/sh\n"
        "mkdir -p .venv/bin\n"
        "printf '#!/bin/sh\\nexit 3\\n' > .venv/bin/python\n"
        "for tool in ruff mypy; do printf '#!/bin/sh\\nexit 0\\n' > .venv/bin/$tool; done\n"
        "chmod +x .venv/bin/*\n"
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    bash = shutil.which("bash")
    assert bash is not None
    done = subprocess.run(
        [bash, str(repo / ".ci" / "run")], env=env, capture_output=True, text=True
    )
    assert done.returncode == 3, done.stderr
    assert "ci: the README's test command failed (exit 3)" in done.stderr
