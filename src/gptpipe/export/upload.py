"""Stage 6: upload a verified stage-4 folder to the HuggingFace hub (6_upload.py), then check the hub copy.

Rules: only a folder whose manifest says ``verified: true`` (and whose files are unchanged since) goes up,
and only the files stage 4 wrote and verified; the repository is private unless the config says otherwise;
the token comes from ``HF_TOKEN`` or the huggingface_hub login store (``hf auth login``), never from the YAML
or the command line, and is never printed. After the upload the files are downloaded back, compared byte
for byte, loaded and asked for a greedy continuation of the test prompt.

`gptpipe evaluate`'s results of this very export (its default output_dir, <folder>/evaluation, current for the
export's manifest) go up with it: evaluation/results.json and results.md, and their table in the uploaded model
card (export.card.with_evaluation); stage 4's README.md itself stays as verified.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from gptpipe.export.card import with_evaluation
from gptpipe.export.config import ConvertConfig
from gptpipe.log import get_logger
from gptpipe.stage import Manifest, StageFailed, StageInputError, file_sha256
from gptpipe.artifacts import CONVERT, EVALUATE, EVALUATION_FOLDER, EXIT_OK, read_export
from gptpipe.storage import is_url

log = get_logger("upload")


def repo_name(config: ConvertConfig) -> str:
    if config.hugging_face_name and not config.huggingface_name:
        log.info("note: `hugging_face_name` is the deprecated spelling (the original README's); "
                 "rename the key to `huggingface_name` in convert_config.yaml")
    if not config.repo_name:
        raise StageInputError("no repository name: set huggingface_name in convert_config.yaml")
    return config.repo_name


RESULTS = ("results.json", "results.md")


def evaluation_files(folder: Path) -> dict[str, Path]:
    """{path in the repository: local file} of `gptpipe evaluate`'s results of this export, if it wrote them to
    its default place and they are current (complete, unchanged, made from the export as it is now); {} else,
    saying why when there are results that do not qualify."""
    out = folder / EVALUATION_FOLDER
    if not EVALUATE.has_manifest(out):
        return {}
    manifest = Manifest.read(EVALUATE.manifest_path(out))
    problems = EVALUATE.problems(manifest, out)
    if not problems and manifest.inputs.get("model") != CONVERT.fingerprint(folder):
        problems = ["they are of an earlier export of this folder"]
    if problems:
        log.warning(f"the evaluation results in {out} stay here: {'; '.join(problems)}. Run `gptpipe evaluate "
                    f"model_dir={folder}` to upload this export's results with it")
        return {}
    return {f"{EVALUATION_FOLDER}/{name}": out / name for name in RESULTS}


def repository_contents(folder: Path, files: list[str]) -> dict[str, Path | bytes]:
    """{path in the repository: local file or bytes}: stage 4's files, and with current evaluation results those
    files and a model card that shows their table."""
    contents: dict[str, Path | bytes] = {name: folder / name for name in files}
    evaluation = evaluation_files(folder)
    if evaluation and "README.md" in contents:
        card = (folder / "README.md").read_text(encoding="utf-8")
        results = json.loads(evaluation[f"{EVALUATION_FOLDER}/results.json"].read_text(encoding="utf-8"))
        table = evaluation[f"{EVALUATION_FOLDER}/results.md"].read_text(encoding="utf-8")
        contents["README.md"] = with_evaluation(card, results, table, EVALUATION_FOLDER).encode()
        contents.update(evaluation)
    return contents


def _sha256(content: Path | bytes) -> str:
    return file_sha256(content) if isinstance(content, Path) else hashlib.sha256(content).hexdigest()


def check_hub_copy(contents: dict[str, Path | bytes], downloaded: Path, prompt: str) -> tuple[list[str], str]:
    """(problems, greedy sample): the downloaded copy must be byte-identical to what was sent, load and generate,
    like the original's smoke test. Its sample is not compared with the gate's: another machine's kernels may
    break a near-tie."""
    from transformers import AutoTokenizer

    from gptpipe.export.adapter import load_export
    from gptpipe.export.verify import greedy_continuation

    problems = [f"{f} differs from the local file" for f, content in contents.items()
                if not (downloaded / f).is_file() or file_sha256(downloaded / f) != _sha256(content)]
    if problems:
        return problems, ""
    task = downloaded / "task.json"  # a fine-tune export says whether it is an encoder-decoder
    seq2seq = task.is_file() and json.loads(task.read_text(encoding="utf-8")).get("seq2seq", False)
    model = load_export(downloaded, seq2seq)  # an adapter folder: on the base its adapter_config.json names
    return [], greedy_continuation(model, AutoTokenizer.from_pretrained(downloaded), prompt)[1]


def run(config: ConvertConfig, args: Any) -> int:
    source = config.output_tokenizer_and_model_dir
    export = read_export(source)  # verified, and unchanged since (a URL: its verified local copy)
    folder = export.folder
    shown = f"{source} (verified copy in {folder})" if is_url(source) else str(folder)
    from huggingface_hub import CommitOperationAdd, HfApi, constants, get_token, snapshot_download

    # Exactly the files stage 4 wrote and verified (its manifest.json and resolved config, with local paths, stay
    # here), and this export's evaluation results.
    contents = repository_contents(folder, list(export.files))
    name = repo_name(config)
    endpoint = os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")
    target = f"{config.organization or '(your user)'}/{name}"
    where = (f"{endpoint}/{target} ({'private' if config.private else 'public'}, "
             f"branch {config.revision or 'main'})")
    if args.dry_run:
        print(f"would upload {len(contents)} files from {shown} to {where}:")
        for f, content in contents.items():
            size = content.stat().st_size if isinstance(content, Path) else len(content)
            note = "  (the model card with the evaluation table)" if isinstance(content, bytes) else ""
            print(f"  {f}  ({size:,} bytes){note}")
        return EXIT_OK

    token = get_token()  # HF_TOKEN, else the login store; nothing else
    if not token:
        raise StageInputError("no HuggingFace token: set HF_TOKEN or run `hf auth login` (a token is never read "
                              "from convert_config.yaml or the command line)")
    api = HfApi(endpoint=endpoint, token=token)
    log.info(f"{len(contents)} files from {shown} → {where}")
    try:
        repo_url = api.create_repo(f"{config.organization}/{name}" if config.organization else name,
                                   private=config.private, exist_ok=True)
        repo_id = repo_url.repo_id
        if config.private and not api.repo_info(repo_id).private:
            raise StageInputError(f"{repo_id} already exists and is public, but convert_config.yaml says private: "
                                  "true. Make it private on the hub, or set private: false to publish")
        if config.revision:
            api.create_branch(repo_id, branch=config.revision, exist_ok=True)
        commit = api.create_commit(
            repo_id, [CommitOperationAdd(path_in_repo=f, path_or_fileobj=str(c) if isinstance(c, Path) else c)
                      for f, c in contents.items()],
            revision=config.revision,
            commit_message=f"gptpipe export of step {export.step} ({export.dtype}, verified)")
        log.info(f"uploaded as commit {commit.oid}; downloading it back to check it")
        with tempfile.TemporaryDirectory(prefix="gptpipe-upload-check-") as tmp:
            downloaded = Path(snapshot_download(repo_id, revision=config.revision, local_dir=tmp,
                                                endpoint=endpoint, token=token))
            problems, sample = check_hub_copy(contents, downloaded, export.test_prompt_text)
    except StageInputError:
        raise
    except Exception as exc:  # network and hub errors of every kind: say what failed, keep the folder as it is
        message = f"{type(exc).__name__}: {exc}".replace(token, "<token>")
        raise StageFailed(f"upload to {endpoint} failed: {message}\nThe local folder {folder} is unchanged; run "
                          "the upload again once the problem is fixed") from None
    url = f"{endpoint}/{repo_id}" + (f"/tree/{config.revision}" if config.revision else "")
    if problems:
        raise StageFailed(f"the hub copy at {url} does not match the verified folder:\n  - "
                          + "\n  - ".join(problems))
    log.info(f"the hub copy is byte-identical, loads and generates: {sample!r}")
    print(url)
    return EXIT_OK
