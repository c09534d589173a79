"""Stage 5: `gptpipe generate` (streamed, --interactive) and the 5_play_with_model notebook, on an exported model."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

from conftest import REPO

from gptpipe.cli import main
from gptpipe.export.generate import Sampling, generate, load

GREEDY = ["--temperature", "0", "--max-new-tokens", "12"]


def generate_cli(workspace: Path, model: Path, *args: str) -> int:
    return main(["generate", "--config", str(workspace / "convert_config.yaml"), "--model", str(model), *args])


def test_generation_streams_in_pieces(exported_model):
    model, tokenizer = load(exported_model)
    pieces: list[str] = []
    text = generate(model, tokenizer, "日本語の", Sampling(max_new_tokens=24, temperature=0), on_text=pieces.append)
    assert len(pieces) > 1, "the text should arrive piece by piece while it is generated"
    assert "".join(pieces) == text and text
    again = generate(model, tokenizer, "日本語の", Sampling(max_new_tokens=24, temperature=0))
    assert again == text  # greedy is deterministic


def test_generate_command_prints_prompt_and_continuation(exported_model, workspace, capsys):
    model, tokenizer = load(exported_model)
    expected = generate(model, tokenizer, "テスト", Sampling(max_new_tokens=12, temperature=0))
    assert generate_cli(workspace, exported_model, "--prompt", "テスト", *GREEDY) == 0
    out, err = capsys.readouterr()
    assert out == "テスト" + expected + "\n"
    assert "temperature=0.0" in err and "warning" not in err


def test_sampling_is_repeatable_with_a_seed(exported_model, workspace, capsys):
    outputs = []
    for _ in range(2):
        assert generate_cli(workspace, exported_model, "--seed", "7", "--max-new-tokens", "16") == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].startswith("こんにちは、")  # test_prompt_text by default


def test_interactive_reads_prompts_until_eof(exported_model, workspace, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("一つ目\n\n二つ目\n"))
    assert generate_cli(workspace, exported_model, "--interactive", *GREEDY) == 0
    out = capsys.readouterr().out
    answers = [line for line in out.split("> ") if line]
    assert len(answers) == 3  # an empty line repeats the previous prompt
    assert answers[0].startswith("一つ目") and answers[1] == answers[0] and answers[2].startswith("二つ目")


def test_unverified_folder_is_flagged(exported_model, workspace, tmp_path, capsys):
    folder = tmp_path / "failed"
    shutil.copytree(exported_model, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["counts"].update(verified=False, failures=["logits differ"])
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert generate_cli(workspace, folder, *GREEDY) == 0
    assert "did not pass verification (logits differ)" in capsys.readouterr().err


def test_notebook_runs_headless(exported_model, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("GPTPIPE_MODEL_DIR", str(exported_model))
    monkeypatch.setenv("GPTPIPE_MAX_NEW_TOKENS", "8")
    notebook = nbformat.read(REPO / "5_play_with_model.ipynb", as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    stdout = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.outputs
                     if o.get("name") == "stdout")
    assert f"{exported_model}: verified by stage 4" in stdout
    assert "parameters" in stdout and "top_p=0.95" in stdout
    for prompt in ("こんにちは、", "日本の首都は", "このコマンドは"):
        assert prompt in stdout
