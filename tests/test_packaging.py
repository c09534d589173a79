"""A plain `pip install .` (a wheel, not the editable install) carries what gptpipe reads at run time."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import REPO

TEMPLATE_IN_WHEEL = "gptpipe/runtime/ds_config_gpt_TEMPLATE.json"

# Run from the installed wheel only: fill the shipped template for a default config, as training does.
FILL_TEMPLATE = """
import json, gptpipe
from gptpipe.config.core import load_config
from gptpipe.pipeline import PipelineConfig
from gptpipe.runtime.engine import TEMPLATE, deepspeed_config
config, _ = deepspeed_config(load_config(PipelineConfig, None, []).train, 2, 1, 1, False)
print(json.dumps({"package": gptpipe.__file__, "template": str(TEMPLATE), "batch": config["train_batch_size"]}))
"""


def test_wheel_ships_the_deepspeed_template(tmp_path: Path) -> None:
    # Build from a copy: an in-tree build would leave build/ and *.egg-info in the checkout.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    # --no-build-isolation: the venv's setuptools builds it, so no network is needed.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(source)], check=True)
    (wheel,) = (tmp_path / "dist").glob("gptpipe-*.whl")

    with zipfile.ZipFile(wheel) as archive:
        shipped = json.loads(archive.read(TEMPLATE_IN_WHEEL))
    # The file users edit at the top level is the one the wheel ships.
    assert (REPO / "original_codes/ds_config_gpt_TEMPLATE.json").resolve() == \
        (REPO / "src" / TEMPLATE_IN_WHEEL).resolve()
    assert shipped == json.loads((REPO / "original_codes/ds_config_gpt_TEMPLATE.json").read_text(encoding="utf-8"))

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True)
    env = {**os.environ, "PYTHONPATH": str(site)}  # the wheel's copy, not src/ nor the editable install
    out = subprocess.run([sys.executable, "-c", FILL_TEMPLATE], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True).stdout
    loaded = json.loads(out.strip().splitlines()[-1])
    assert Path(loaded["package"]).is_relative_to(site)
    assert Path(loaded["template"]) == site / TEMPLATE_IN_WHEEL
    assert loaded["batch"] == 2  # micro-batch 2, one step, one rank
