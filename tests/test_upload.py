"""Stage 6: upload rules, against a local hub server (tests/hub_server.py) on 127.0.0.1."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from conftest import HUB_TOKEN as TOKEN

from gptpipe.cli import main
from gptpipe.stage import file_fingerprint, tree_fingerprint

LOCAL_ONLY = {"manifest.json", "convert.resolved.yaml"}
REPO_EVALUATE = Path(__file__).resolve().parents[1] / "evaluate_config.yaml"


@pytest.fixture
def folder(exported_model, tmp_path) -> Path:
    """A private copy of the verified export (copy2 keeps the mtimes its manifest vouches for)."""
    copy = tmp_path / "export"
    shutil.copytree(exported_model, copy)
    return copy


def upload(workspace: Path, folder: Path, *args: str) -> int:
    return main(["upload", "--config", str(workspace / "convert_config.yaml"),
                 f"output_tokenizer_and_model_dir={folder}", *args])


def uploaded_files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_file()} - LOCAL_ONLY


def test_upload_arrives_byte_identical_private_and_without_leaking_the_token(
        hub, folder, workspace, monkeypatch, capsys, caplog):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    caplog.set_level(logging.DEBUG)
    assert upload(workspace, folder, "huggingface_name=tiny-ja", "organization=lab", "revision=v1") == 0
    out, err = capsys.readouterr()
    repo = hub.repos["lab/tiny-ja"]
    assert repo.private is True
    files = repo.branches["v1"]
    assert set(files) == uploaded_files(folder)
    for name, data in files.items():
        assert data == (folder / name).read_bytes(), name
    assert "model.safetensors" in repo.lfs_files  # the weights went through LFS (batch, PUT, verify)
    assert out.strip() == f"{hub.url}/lab/tiny-ja/tree/v1"
    assert "byte-identical" in err
    # The token went to the server and nowhere else: not in output, logs, uploaded files or the workspace.
    creates = [auth for method, path, auth in hub.requests if "/api/repos/create" in path]
    assert creates and all(auth == f"Bearer {TOKEN}" for auth in creates)
    assert TOKEN not in out + err + caplog.text
    assert "huggingface.co" not in err + caplog.text  # every request went to the local server
    assert not any(TOKEN.encode() in data for data in files.values())
    for path in workspace.rglob("*"):
        if path.is_file() and path.stat().st_size < 50_000_000:
            assert TOKEN.encode() not in path.read_bytes(), path


def test_token_from_the_login_store(hub, folder, workspace, capsys):
    import huggingface_hub

    Path(huggingface_hub.constants.HF_TOKEN_PATH).parent.mkdir(parents=True)
    Path(huggingface_hub.constants.HF_TOKEN_PATH).write_text(TOKEN)
    assert upload(workspace, folder) == 0
    assert hub.repos["tester/gptpipe-demo-ja"].private is True  # name from the shipped YAML, user namespace
    assert TOKEN not in "".join(capsys.readouterr())


def test_existing_public_repository_is_not_published_into(hub, folder, workspace, monkeypatch, capsys):
    from hub_server import Repo

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.repos["tester/gptpipe-demo-ja"] = Repo(private=False)
    assert upload(workspace, folder) == 2
    assert "already exists and is public" in capsys.readouterr().err
    assert hub.repos["tester/gptpipe-demo-ja"].branches["main"] == {}


def test_no_token_sends_nothing(hub, folder, workspace, capsys):
    assert upload(workspace, folder) == 2
    assert "set HF_TOKEN or run `hf auth login`" in capsys.readouterr().err
    assert hub.requests == []


def test_unverified_folder_is_refused_and_nothing_is_sent(hub, folder, workspace, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    manifest_path = folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["counts"].update(verified=False, failures=["tokenizer ids differ from SentencePiece on 3/33 texts"])
    manifest_path.write_text(json.dumps(manifest))
    assert upload(workspace, folder) == 2
    err = capsys.readouterr().err
    assert "did not pass verification" in err and "tokenizer ids differ" in err
    assert hub.requests == []


def test_folder_changed_after_verification_is_refused(hub, folder, workspace, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    (folder / "config.json").write_text((folder / "config.json").read_text().replace('"vocab_size"', '"vocab_size" '))
    assert upload(workspace, folder) == 2
    assert "changed after the stage finished" in capsys.readouterr().err
    assert hub.requests == []


def test_server_error_is_clear_and_leaves_the_folder_untouched(hub, folder, workspace, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.fail_on = "/commit/"
    before = tree_fingerprint(list(folder.rglob("*")))
    manifest_before = file_fingerprint(folder / "manifest.json")
    assert upload(workspace, folder) == 1
    err = capsys.readouterr().err
    assert "upload to" in err and "failed" in err and "500" in err and "simulated server failure" in err
    assert "local folder" in err and "unchanged" in err and "FAILED" in err
    assert TOKEN not in err
    assert tree_fingerprint(list(folder.rglob("*"))) == before
    assert file_fingerprint(folder / "manifest.json") == manifest_before
    assert hub.repos["tester/gptpipe-demo-ja"].branches["main"] == {}  # nothing was committed


def test_hub_copy_that_differs_is_reported(hub, folder, workspace, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.corrupt_download = "tokenizer.json"
    assert upload(workspace, folder) == 1
    err = capsys.readouterr().err
    assert "does not match the verified folder" in err and "tokenizer.json differs from the local file" in err


def test_dry_run_lists_files_and_destination_without_a_token(hub, folder, workspace, capsys):
    assert upload(workspace, folder, "organization=lab", "--dry-run") == 0
    out = capsys.readouterr().out
    assert f"to {hub.url}/lab/gptpipe-demo-ja (private, branch main)" in out
    listed = {line.split()[0] for line in out.splitlines()[1:]}
    assert listed == uploaded_files(folder)
    assert hub.requests == []


def test_deprecated_key_spelling_is_accepted_with_a_note(hub, folder, workspace, tmp_path, capsys):
    config = tmp_path / "convert_config.yaml"
    config.write_text(f"output_tokenizer_and_model_dir: {folder}\nhugging_face_name: old-spelling\n")
    assert main(["upload", "--config", str(config), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "/(your user)/old-spelling" in out
    assert "deprecated spelling" in err and "huggingface_name" in err


def test_token_is_not_a_config_key(folder, tmp_path, capsys):
    config = tmp_path / "convert_config.yaml"
    config.write_text(f"output_tokenizer_and_model_dir: {folder}\nhf_token: {TOKEN}\n")
    assert main(["upload", "--config", str(config), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "hf_token" in err and "unknown key" in err
    assert TOKEN not in err


@pytest.fixture(scope="module")
def demo_task_yaml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo task (make-demo-task on the man pages) in a folder of this module's own: its task YAML."""
    from conftest import REPO, run_cli

    folder = tmp_path_factory.mktemp("demo-task")
    shutil.copy(REPO / "evaluate_config.yaml", folder / "evaluate_config.yaml")
    run_cli("make-demo-task", "--config", folder / "evaluate_config.yaml", f"demo_task.output_dir={folder / 'task'}")
    return folder / "task" / "manpage_section.yaml"


def test_evaluation_results_of_the_export_go_up_with_it_and_into_the_card(
        hub, folder, workspace, demo_task_yaml, monkeypatch, capsys):
    """`gptpipe evaluate` on the export (default output_dir: <folder>/evaluation), then the upload: the results
    files and a card with their table arrive; stage 4's README.md stays as verified; an evaluation made before the
    export changed stays behind, said so."""
    pytest.importorskip("lm_eval")
    from gptpipe.artifacts import read_export
    from gptpipe.export.card import with_evaluation

    card = (folder / "README.md").read_bytes()
    assert main(["evaluate", "--config", str(REPO_EVALUATE), f"model_dir={folder}", "tasks=[]",
                 f"task_yamls=[{demo_task_yaml}]", "limit=6"]) == 0
    results = folder / "evaluation"
    table = (results / "results.md").read_text(encoding="utf-8")
    assert "| manpage_section | 0 | acc |" in table
    capsys.readouterr()

    assert upload(workspace, folder, "--dry-run") == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]}
    assert listed == uploaded_files(folder) | {"evaluation/results.json", "evaluation/results.md"}

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert upload(workspace, folder, "huggingface_name=evaluated", "organization=lab") == 0
    files = hub.repos["lab/evaluated"].branches["main"]
    assert set(files) == uploaded_files(folder) | {"evaluation/results.json", "evaluation/results.md"}
    assert files["evaluation/results.json"] == (results / "results.json").read_bytes()
    assert files["evaluation/results.md"] == table.encode()
    hub_card = files["README.md"].decode()
    assert hub_card == with_evaluation(card.decode(), json.loads((results / "results.json").read_text()), table,
                                       "evaluation")
    assert hub_card.index("## Results") < hub_card.index("## Evaluation") < hub_card.index("## Architecture")
    assert table.strip() in hub_card
    assert (folder / "README.md").read_bytes() == card
    read_export(folder)  # still the verified export

    # A new export of the folder (its manifest rewritten) leaves the old results behind, with the reason.
    manifest = folder / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"created": "', '"created": "re-exported '))
    capsys.readouterr()
    assert upload(workspace, folder, "--dry-run") == 0
    out, err = capsys.readouterr()
    assert "evaluation/" not in out and "of an earlier export of this folder" in err
