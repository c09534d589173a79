"""`gptpipe evaluate`'s generation tasks through vLLM (gptpipe.eval_generation, evaluate_config `generation`): the
llm-jp-eval fixture folder of test_evaluate_llmjp.py, scored on a real stage-4 export (conftest's tiny_export with
vLLM's smallest heads, as test_vllm.py serves) by transformers and by vLLM's CPU build in its own venv: the same
generated texts in lm-eval's own record of every document, the same scores. The vLLM tier is skipped, with the
reason, where scripts/setup_vllm.sh's venv is absent; the choice of generator is checked everywhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, run_cli
from gptpipe import llmjp_eval
from gptpipe.eval_generation import VLLM_FROM_PARAMETERS, Generator, GeneratingLM, choose
from gptpipe.export.runtimes import vllm as vllm_runtime
from gptpipe.export.runtimes.vllm import Vllm
from gptpipe.stage import Manifest, StageInputError
from test_evaluate_llmjp import TASKS, TEST_DOCS, command_rows, write_llmjp

VLLM_MISSING = Vllm(Path()).missing()


def needs_vllm(test):
    """The vLLM tier: its CPU build in scripts/setup_vllm.sh's venv; skipped, with the reason, where it is absent."""
    for mark in (pytest.mark.vllm, pytest.mark.slow,
                 pytest.mark.skipif(VLLM_MISSING is not None, reason=str(VLLM_MISSING))):
        test = mark(test)
    return test

VLLM_HEAD_DIM = 32  # vLLM's CPU attention's smallest head size (test_vllm.py)
STOPS = ["の", "る"]  # stop strings the tiny export's JSQuAD generations run past (its "。" and newlines are rare)


def test_auto_falls_back_to_transformers_where_vllm_cannot_run(tmp_path: Path, monkeypatch) -> None:
    """Without vLLM importable here (gptpipe's venv) and without its venv: auto says why it chose transformers;
    vllm is an error naming the setup script; transformers is what was asked."""
    from importlib.util import find_spec

    assert find_spec("vllm") is None  # gptpipe's own venv: vLLM runs only in its own
    monkeypatch.setattr(vllm_runtime, "VLLM_HOME", tmp_path / "no-vllm")
    auto = choose("auto", tmp_path, VLLM_FROM_PARAMETERS)
    assert auto.name == "transformers" and "scripts/setup_vllm.sh" in auto.reason and "no vLLM venv" in auto.reason
    with pytest.raises(StageInputError, match="generation: vllm, but vLLM does not import here and no vLLM venv"):
        choose("vllm", tmp_path, VLLM_FROM_PARAMETERS)
    assert choose("transformers", tmp_path, VLLM_FROM_PARAMETERS).reason == "generation: transformers"


@pytest.fixture(scope="module")
def llama(tiny_export) -> Path:
    return tiny_export("vllm", head_dim=VLLM_HEAD_DIM)


def scored(folder: Path, specs: list[dict], generator: Generator) -> dict:
    import lm_eval

    from gptpipe.evaluate import _hf_lm
    from gptpipe.lm_tasks import load_tasks

    model = GeneratingLM(_hf_lm(folder, "float32", 1, "cpu"), generator, folder, "float32")
    return lm_eval.simple_evaluate(model=model, tasks=specs, log_samples=True, task_manager=load_tasks(specs, "-"))


@needs_vllm
def test_vllm_generates_transformers_texts_and_scores(llama: Path, tmp_path: Path) -> None:
    """Every document of the three llm-jp-eval tasks (two shots, 1-25 new tokens each) and of JSQuAD with stop
    strings: the generation lm-eval logged (resps) and the one its filters kept (filtered_resps) are the same texts
    from vLLM as from transformers, so every document's scores and every task's figure are too; the generator
    counted every request and its time."""
    from gptpipe.lm_tasks import summarize

    test = write_llmjp(tmp_path, command_rows())
    specs = llmjp_eval.task_dicts(test, num_fewshot=2)
    # JSQuAD again with stop strings (llm-jp-eval's tasks have none): the texts cut where HFLM cuts them
    jsquad = next(s for s in specs if s["task"] == "llmjp_jsquad")
    specs.append({**jsquad, "task": "llmjp_jsquad_until",
                  "generation_kwargs": {**jsquad["generation_kwargs"], "until": STOPS}})
    runs = {}
    for name in ("transformers", "vllm-venv"):
        generator = Generator(name, "test")
        runs[name] = (scored(llama, specs, generator), generator)
    (hf, hf_gen), (vl, vl_gen) = runs["transformers"], runs["vllm-venv"]
    assert hf_gen.requests == vl_gen.requests == (len(TASKS) + 1) * TEST_DOCS and vl_gen.generate_s > 0
    texts = []
    for task in [*(f"llmjp_{name}" for name in TASKS), "llmjp_jsquad_until"]:
        assert len(hf["samples"][task]) == len(vl["samples"][task]) == TEST_DOCS
        for a, b in zip(hf["samples"][task], vl["samples"][task], strict=True):
            assert a["doc_id"] == b["doc_id"] and a["arguments"] == b["arguments"]
            assert (a["resps"], a["filtered_resps"]) == (b["resps"], b["filtered_resps"]), (task, a["doc_id"])
            texts.append(a["resps"][0][0])
    assert summarize(hf) == summarize(vl)
    whole, cut = ([s["resps"][0][0] for s in vl["samples"][task]] for task in ("llmjp_jsquad", "llmjp_jsquad_until"))
    assert all(w.startswith(c) and not any(stop in c for stop in STOPS) for w, c in zip(whole, cut, strict=True))
    assert whole != cut, whole  # some generation went past a stop string
    assert any(texts) and len(set(texts)) > 1, texts  # generations to compare, not empty strings


@needs_vllm
def test_evaluate_records_which_generator_ran(llama: Path, tmp_path: Path) -> None:
    """On a machine with vLLM's venv, auto picks vLLM for a model of VLLM_FROM_PARAMETERS and transformers for the
    tiny export (it generates faster than vLLM starts); `gptpipe evaluate` with generation vllm: vLLM generated
    (results.json and the manifest say so, with its time), and the scores are those generation: transformers
    gives."""
    assert choose("auto", llama, VLLM_FROM_PARAMETERS).name == "vllm-venv"
    test = write_llmjp(tmp_path / "llm-jp-eval", command_rows())
    results = {}
    for generation in ("auto", "vllm", "transformers"):
        out = tmp_path / generation
        run_cli("evaluate", "--config", REPO / "evaluate_config.yaml", f"model_dir={llama}", "tasks=[]",
                f"task_dirs=[{test}]", "num_fewshot=2", "batch_size=1", f"generation={generation}",
                f"output_dir={out}")
        results[generation] = json.loads((out / "results.json").read_text(encoding="utf-8"))
        manifest = Manifest.read(out / "manifest.json")
        ran = results[generation]["generation"]
        assert manifest.counts["generator"] == ran["generator"]
        assert manifest.timings["generate_s"] == ran["generate_s"] > 0
        assert ran["requests"] == len(TASKS) * TEST_DOCS
    assert results["vllm"]["generation"]["generator"] == "vllm-venv"
    assert "scripts/setup_vllm.sh" in results["vllm"]["generation"]["reason"]
    assert results["auto"]["generation"]["generator"] == "transformers"
    assert "generates faster than vLLM starts" in results["auto"]["generation"]["reason"]
    assert results["transformers"]["generation"]["generator"] == "transformers"
    assert results["vllm"]["tasks"] == results["transformers"]["tasks"]
