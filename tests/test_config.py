"""The config system: shipped YAMLs load, problems are collected into one message, overrides are typed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import REPO
from gptpipe.cli import COMMANDS, build_parser, main, parse_command_line
from gptpipe.config.core import ConfigError, describe, load_config
from gptpipe.pipeline import PipelineConfig
from gptpipe.export.config import ConvertConfig
from gptpipe.tokenizer.config import TokenizerConfig


def yaml_leaves(node: object, key: str = ""):
    """(dotted key, value) of every scalar or list of scalars a YAML mapping sets; list items as key.N."""
    if isinstance(node, dict):
        for name, value in node.items():
            yield from yaml_leaves(value, f"{key}.{name}" if key else name)
    elif isinstance(node, list) and any(isinstance(item, dict) for item in node):
        for i, item in enumerate(node):
            yield from yaml_leaves(item, f"{key}.{i}")
    else:
        yield key, node


def config_value(config: object, key: str) -> object:
    for part in key.split("."):
        config = config[int(part)] if part.isdigit() else getattr(config, part)
    return config


@pytest.mark.parametrize("command", COMMANDS, ids=lambda cmd: cmd.name)
def test_every_command_applies_every_key_of_its_default_yaml(command) -> None:
    """Each command's shipped YAML loads, and every value it writes is the value the stage gets."""
    module, cls_name = command.config_class.split(":")
    cls = getattr(__import__(module, fromlist=[cls_name]), cls_name)
    path = REPO / command.default_config
    config = load_config(cls, path)
    leaves = list(yaml_leaves(yaml.safe_load(path.read_text(encoding="utf-8"))))
    assert len(leaves) > 5, leaves
    for key, written in leaves:
        loaded = config_value(config, key)
        if isinstance(loaded, Path):  # relative paths are relative to the YAML's folder
            written = (path.parent / written).resolve()
        elif isinstance(loaded, list) and loaded and isinstance(loaded[0], Path):
            written = [(path.parent / p).resolve() for p in written]
        assert loaded == written, f"{path.name} {key}: wrote {written!r}, loaded {loaded!r}"


def test_original_key_names_are_kept() -> None:
    """The shipped YAMLs are written with the original pipeline's key names (the test above checks each one
    lands), and the original README's spelling hugging_face_name still names the hub repository."""
    def keys(name: str) -> set[str]:
        return {key for key, _ in yaml_leaves(yaml.safe_load((REPO / name).read_text(encoding="utf-8")))}

    assert {"input", "output_dir", "vocab_size", "model_type", "character_coverage", "model_prefix",
            "num_threads"} <= keys("sentence_piece_config.yaml")
    assert {"input_model_dir", "output_tokenizer_and_model_dir", "huggingface_name"} <= keys("convert_config.yaml")
    assert {"train.global_batch_size", "train.train_tokens", "data.split"} <= keys("config.yaml")
    legacy = load_config(ConvertConfig, None, ["hugging_face_name=old-spelling"])
    assert legacy.repo_name == "old-spelling"


def test_the_original_pipelines_yaml_still_loads(tmp_path: Path) -> None:
    """A user's sentence_piece_config.yaml from the original pipeline works unchanged."""
    original = tmp_path / "sentence_piece_config.yaml"
    original.write_text("input: ../../data/text/wiki.jsonl\noutput_dir: ../../models/tokenizers/wiki_65k\n"
                        "vocab_size: 65000\nnum_threads: 32\nmodel_prefix: tokenizer\ncharacter_coverage: 0.9995\n"
                        "model_type: unigram #character_coverage\ntrain_extremely_large_corpus: True\n",
                        encoding="utf-8")
    config = load_config(TokenizerConfig, original)
    assert config.vocab_size == 65000 and config.output_dir == (tmp_path / "../../models/tokenizers/wiki_65k").resolve()


def test_all_problems_are_reported_at_once_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("corpus:\n  min_chars: -1\n  sorces: []\ntrain:\n  global_batch_size: abc\n  precison: bf16\n"
                    "model:\n  arch: lama\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(PipelineConfig, path, ["train.seq_len=foo"])
    problems = info.value.problems
    assert len(problems) == 6, problems
    text = str(info.value)
    assert f"{path}:3 corpus.sorces: unknown key; did you mean corpus.sources?" in text
    assert f"{path}:2 corpus.min_chars: must be >= 0" in text
    assert f"{path}:5 train.global_batch_size: expected an integer, got 'abc'" in text
    assert "train.precison: unknown key; did you mean train.precision?" in text
    assert "model.arch: must be one of 'llama', 'gpt2', 'mixtral', got 'lama'; did you mean 'llama'?" in text
    assert "command-line override train.seq_len: expected an integer, got 'foo'" in text


def test_cross_field_contradictions(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(PipelineConfig, None, ["train.lr=1e-4", "train.min_lr=1e-3", "train.micro_batch_size=5",
                                           "data.weights=[1.0]", "data.prefixes=[a, b]", "data.split=90,10"])
    text = str(info.value)
    assert "train.min_lr: must be between 0 and lr" in text
    assert "train.micro_batch_size: 5 does not divide global_batch_size" in text
    assert "data.weights: 1 weights for 2 prefixes" in text
    assert "data.split: must be three non-negative numbers" in text


def test_overrides_are_typed_and_paths_resolve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    yaml_dir = tmp_path / "project"
    yaml_dir.mkdir()
    (yaml_dir / "config.yaml").write_text("tokenize:\n  output_prefix: data/x\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    config = load_config(PipelineConfig, yaml_dir / "config.yaml",
                         ["train.lr=3e-4", "train.train_tokens=1_000_000", "tokenize.input=[a.jsonl, b.jsonl]",
                          "corpus.dedup=false"])
    assert config.train.lr == 3e-4 and config.train.train_tokens == 1_000_000
    assert config.corpus.dedup is False
    assert config.tokenize.output_prefix == yaml_dir / "data" / "x"  # YAML paths: relative to the YAML
    assert config.tokenize.input == [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]  # overrides: to the cwd
    assert config.corpus.output_dir == yaml_dir / "data" / "corpus"  # defaults: relative to the YAML too


def test_bad_yaml_and_missing_file_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    broken = tmp_path / "config.yaml"
    broken.write_text("corpus: [unclosed\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(PipelineConfig, broken)
    assert main(["count", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_overrides_are_taken_on_both_sides_of_an_option(capsys: pytest.CaptureFixture) -> None:
    line = ["predict", "train.output_model_dir=runs/x", "--input", "test.tsv", "predict.num_beams=3"]
    args = parse_command_line(line)
    assert args.overrides == ["train.output_model_dir=runs/x", "predict.num_beams=3"] and args.input == "test.tsv"
    for cmd in COMMANDS:
        required = ["--shards", "2"] if cmd.name == "merge" else []
        args = parse_command_line([cmd.name, "a.b=1", "--config", "c.yaml", "d.e=2", "--force", "f.g=3", *required])
        assert args.overrides == ["a.b=1", "d.e=2", "f.g=3"] and args.config == Path("c.yaml") and args.force
    assert parse_command_line(["generate", "--prompt", "x=y", "a.b=1"]).prompt == ["x=y"]  # an option's value
    with pytest.raises(SystemExit):
        parse_command_line(["count", "a.b=1", "--bogus", "c.d=2"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    # Both reach the config: the one after the option is checked like the first.
    assert main(["count", "train.seq_len=64", "--config", str(REPO / "config.yaml"), "train.nope=1"]) == 2
    assert "train.nope" in capsys.readouterr().err


def test_help_lists_every_key_with_doc() -> None:
    keys = {row[0] for row in describe(PipelineConfig)}
    assert {"corpus.min_chars", "corpus.sources.N.type", "tokenize.workers", "train.train_tokens",
            "train.global_batch_size", "model.arch"} <= keys
    assert all(doc for _, _, _, doc in describe(TokenizerConfig))
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    epilog = sub.choices["prepare"].epilog
    assert "corpus.min_chars (int, default 50)" in epilog


def test_source_labels_are_derived_unique_and_checked(tmp_path: Path) -> None:
    from gptpipe.corpus.config import SourceConfig, source_labels

    sources = [SourceConfig(type="manpages", path=Path("/usr/share/man/ja")),
               SourceConfig(type="jsonl", path=Path("raw/*.jsonl")),
               SourceConfig(type="jsonl", path=Path("x.jsonl.gz")),
               SourceConfig(type="hf_dataset", name="HuggingFaceFW/fineweb-2", subset="jpn_Jpan"),
               SourceConfig(type="jsonl", path=Path("a/raw.jsonl"), label="raw"), SourceConfig()]
    # derived from the path's or hub name's last part; one another source has gets its number
    assert source_labels(sources) == ["ja", "raw-1", "x", "fineweb-2-jpn_Jpan", "raw", "manpages"]
    config = tmp_path / "config.yaml"
    for sources, problem in (("[{type: jsonl, path: a.jsonl, label: web}, {type: jsonl, path: b.jsonl, label: web}]",
                              "corpus.sources: label 'web' is given to more than one source"),
                             ("[{type: jsonl, path: c.jsonl, label: ../c}]",
                              "corpus.sources.0.label: '../c': use letters")):
        config.write_text(f"corpus:\n  sources: {sources}\n", encoding="utf-8")
        with pytest.raises(ConfigError) as err:
            load_config(PipelineConfig, config)
        assert problem in str(err.value)
