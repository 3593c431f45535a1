"""``--config FILE.yaml`` (kvserve.entrypoints.config_file): flags read from a YAML mapping."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import yaml

from kvserve.config.speculative import SpeculativeConfig
from kvserve.engine.engine_args import EngineArgs
from kvserve.cli import build_parser, engine_args_from_config
from kvserve.entrypoints.config_file import (ConfigFileError, ConfigFileParser,
                                             add_config_argument, config_to_argv, load_config)


def write(tmp_path, data, name="tuned.yaml") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return str(path)


def parse(*argv):
    return build_parser().parse_args(list(argv))


def subparser(name: str) -> argparse.ArgumentParser:
    sub, = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


def fails(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


# -- serve: engine and server keys, both spellings ------------------------------------------

MIXED = {
    "model": "/models/tuned",             # serve's positional
    "host": "0.0.0.0",
    "port": 9001,
    "api-key": "sekrit",
    "served_model_name": "tuned-model",
    "max-waiting": 7,
    "log_stats_interval": 2.5,
    "metrics-prefix": "vllm",
    "disable_access_log": True,
    "max-num-seqs": 64,
    "max_num_batched_tokens": 4096,
    "kv-cache-memory": "2GiB",
    "block_size": 32,
    "dtype": "float32",
    "enable-prefix-caching": False,
    "bucket_window_s": 0.25,
    "max-model-len": None,                # null: the default
}


def test_mixed_file_lands_in_the_namespace(tmp_path):
    args = parse("serve", "--config", write(tmp_path, MIXED))
    for key, value in MIXED.items():
        assert getattr(args, key.replace("-", "_")) == value, key
    assert args.config.endswith("tuned.yaml")
    assert args.func.__name__ == "_serve"
    engine = EngineArgs.from_cli_args(args)
    assert (engine.max_num_seqs, engine.block_size, engine.enable_prefix_caching) == \
        (64, 32, False)
    assert engine.max_model_len is None


def test_config_equals_form_and_position(tmp_path):
    path = write(tmp_path, {"max_num_seqs": 3})
    assert parse("serve", f"--config={path}").max_num_seqs == 3
    assert parse("serve", "--port", "1", "--config", path, "--host", "h").max_num_seqs == 3


def test_command_line_overrides_the_file(tmp_path):
    path = write(tmp_path, MIXED)
    args = parse("serve", "--max-num-seqs", "5", "--config", path, "--port=1",
                 "--enable-prefix-caching", "/cli/model")
    assert (args.max_num_seqs, args.port, args.enable_prefix_caching, args.model) == \
        (5, 1, True, "/cli/model")
    assert args.max_num_batched_tokens == 4096  # the rest still from the file


def test_no_config_is_unchanged():
    args = parse("serve", "--max-num-seqs", "5")
    assert args.config is None and args.max_num_seqs == 5 and args.enable_prefix_caching is None


@pytest.mark.parametrize("value", [True, False])
def test_booleans_both_ways(tmp_path, value):
    args = parse("serve", "--config", write(tmp_path, {"enable_prefix_caching": value,
                                                       "disable-access-log": value}))
    assert args.enable_prefix_caching is value
    assert args.disable_access_log is value
    # and the command line flips the file's either way
    flag = "--no-enable-prefix-caching" if value else "--enable-prefix-caching"
    args = parse("serve", "--config", write(tmp_path, {"enable_prefix_caching": value}), flag)
    assert args.enable_prefix_caching is (not value)


def test_boolean_flag_needs_a_boolean(tmp_path, capsys):
    err = fails(capsys, "serve", "--config", write(tmp_path, {"enable_prefix_caching": "no"}))
    assert "enable_prefix_caching" in err and "true or false" in err
    err = fails(capsys, "serve", "--config", write(tmp_path, {"disable_access_log": 1}))
    assert "disable_access_log" in err


def test_speculative_config_mapping(tmp_path):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    args = parse("serve", "--config", write(tmp_path, {"speculative_config": spec}))
    assert json.loads(args.speculative_config) == spec
    engine = EngineArgs.from_cli_args(args)
    assert SpeculativeConfig.from_value(engine.speculative_config) == SpeculativeConfig(**spec)
    # JSON text as on the command line works as well
    args = parse("serve", "--config", write(tmp_path, {"speculative-config": json.dumps(spec)}))
    assert json.loads(args.speculative_config) == spec


def test_numbers_and_none(tmp_path):
    args = parse("serve", "--config", write(tmp_path, "shutdown_timeout: 5\n"
                                                      "swap_space: 1.5e0\n"
                                                      "num_kv_blocks: ~\n"
                                                      "max_batch_lines_in_flight: null\n"
                                                      "seed: -3\n"))
    assert args.shutdown_timeout == 5.0 and isinstance(args.shutdown_timeout, float)
    assert args.swap_space == 1.5
    assert args.num_kv_blocks is None and args.max_batch_lines_in_flight is None
    assert args.seed == -3


# -- errors ----------------------------------------------------------------------------------

def test_unknown_key_names_it_and_suggests(tmp_path, capsys):
    err = fails(capsys, "serve", "--config", write(tmp_path, {"max_num_seq": 3}))
    assert "unknown key 'max_num_seq'" in err and "did you mean 'max_num_seqs'" in err
    err = fails(capsys, "serve", "--config", write(tmp_path, {"enable-prefix-cashing": True}))
    assert "'enable-prefix-cashing'" in err and "'enable-prefix-caching'" in err
    err = fails(capsys, "serve", "--config", write(tmp_path, {"zzzqqq": 1}))
    assert "unknown key 'zzzqqq'" in err


def test_unknown_key_is_never_ignored_by_config_to_argv():
    with pytest.raises(ConfigFileError, match="unknown key 'prot'.*'port'"):
        config_to_argv({"prot": 1}, subparser("serve"))
    # a generate flag is no serve key
    with pytest.raises(ConfigFileError, match="unknown key 'temperature'"):
        config_to_argv({"temperature": 0.5}, subparser("serve"))


def test_wrong_type_gets_argparse_error(tmp_path, capsys):
    err = fails(capsys, "serve", "--config", write(tmp_path, {"max_num_seqs": "many"}))
    assert "argument --max-num-seqs: invalid int value: 'many'" in err
    err = fails(capsys, "serve", "--config", write(tmp_path, {"max-num-seqs": 1.5}))
    assert "argument --max-num-seqs: invalid int value: '1.5'" in err
    err = fails(capsys, "serve", "--config", write(tmp_path, {"kv_manager": "nope"}))
    assert "argument --kv-manager: invalid choice: 'nope'" in err
    err = fails(capsys, "serve", "--config", write(tmp_path, {"port": [1, 2]}))
    assert "port in" in err and "takes one value, got the list [1, 2]" in err


@pytest.mark.parametrize("text", ["- max_num_seqs\n- 3\n", "just text\n", "42\n"])
def test_non_mapping_file_is_an_error(tmp_path, capsys, text):
    path = write(tmp_path, text)
    with pytest.raises(ConfigFileError, match="must hold a mapping"):
        load_config(path)
    assert "must hold a mapping" in fails(capsys, "serve", "--config", path)


def test_file_errors(tmp_path, capsys):
    assert "cannot read config file" in fails(capsys, "serve", "--config",
                                              str(tmp_path / "missing.yaml"))
    assert "not valid YAML" in fails(capsys, "serve", "--config",
                                     write(tmp_path, "a: [1\n"))
    assert "the same setting" in fails(capsys, "serve", "--config",
                                       write(tmp_path, "max-num-seqs: 1\nmax_num_seqs: 2\n"))
    assert "given twice" in fails(capsys, "serve", "--config",
                                  write(tmp_path, "port: 1\nport: 2\n"))
    assert "more than once" in fails(capsys, "serve", "--config", write(tmp_path, {}),
                                     "--config", write(tmp_path, {}))
    assert "expected one argument" in fails(capsys, "serve", "--config")
    assert "another config file" in fails(capsys, "serve", "--config",
                                          write(tmp_path, {"config": "other.yaml"}))
    assert "spell --config out in full" in fails(capsys, "serve", "--conf",
                                                 write(tmp_path, {}))


def test_empty_file_changes_nothing(tmp_path):
    args = parse("serve", "--config", write(tmp_path, ""))
    assert args.max_num_seqs is None and args.port == 8000


# -- run-batch and generate --------------------------------------------------------------

def test_run_batch_config(tmp_path):
    path = write(tmp_path, {"input-file": "in.jsonl", "output_file": "out.jsonl",
                            "model": "/m", "max_lines_in_flight": 9, "max-num-seqs": 8})
    args = parse("run-batch", "--config", path)
    assert (args.input_file, args.output_file, args.model, args.max_lines_in_flight,
            args.max_num_seqs) == ("in.jsonl", "out.jsonl", "/m", 9, 8)
    assert parse("run-batch", "--config", path, "-o", "x.jsonl").output_file == "x.jsonl"


def test_generate_config(tmp_path):
    path = write(tmp_path, {"model": "/m", "max_tokens": 5, "temperature": 0.5,
                            "stop": ["\n", "."], "block-size": 8, "prompt": ["hi"]})
    args = parse("generate", "--config", path)
    assert (args.model, args.max_tokens, args.temperature, args.stop, args.block_size,
            args.prompt) == ("/m", 5, 0.5, ["\n", "."], 8, ["hi"])
    # the command line's prompts and repeatable --stop replace the file's
    args = parse("generate", "--config", path, "--stop", "!", "one", "two")
    assert (args.stop, args.prompt) == (["!"], ["one", "two"])
    # a single value for a repeatable flag
    assert parse("generate", "--config", write(tmp_path, {"stop": "x"})).stop == ["x"]


def test_generate_end_to_end(tmp_path, llama_dir, capsys):
    from kvserve.cli import main
    path = write(tmp_path, {"model": llama_dir, "max_tokens": 3, "num_kv_blocks": 32,
                            "enable_prefix_caching": False, "attention_backend": "torch"})
    assert main(["generate", "--config", path, "hello"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("hello") and "3 tokens" in out.err


def test_other_parsers_keep_plain_behaviour():
    p = ConfigFileParser(prog="x")
    p.add_argument("--config")  # not add_config_argument's: an ordinary option
    assert p.parse_args(["--config", "f"]).config == "f"
    q = ConfigFileParser(prog="y")
    q.add_argument("--n", type=int)
    add_config_argument(q)
    assert q.parse_args(["--n", "2"]).n == 2


# -- every EngineArgs field round-trips through serve --config -----------------------------

# values no rule derives (free-form strings, sizes, the mapping)
TABLE = {
    "model": "/models/tuned",
    "kv_cache_memory": "3GiB",
    "kv_offload_dir": "/var/cache/kv-tier",
    "kv_offload_size": "8GiB",
    "warmup_prompts": "/etc/kvserve/prompts.txt",
    "omp_threads_bind": "0-3",
    "tuning_plan": "/etc/kvserve/tuning-plan.json",
    "generation_config": "vllm",
    "tokenizer": "/models/tuned-tokenizer",
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                           "prompt_lookup_min": 1, "prompt_lookup_max": 3},
}


def _choices(f: dataclasses.Field):
    if "choices" in f.metadata:
        return list(f.metadata["choices"])
    if "registry" in f.metadata:
        return list(f.metadata["registry"].names())
    return None


def non_default(f: dataclasses.Field):
    """A valid value other than the field's default."""
    if f.name in TABLE:
        return TABLE[f.name]
    default, kind = f.default, str(f.type)
    choices = _choices(f)
    if isinstance(default, bool):
        return not default
    if choices:
        return next(c for c in choices if c != default)
    if kind.startswith("int"):
        return 3 if default is None else default + 1
    if kind.startswith("float"):
        return default / 2  # 0.05, 0.5, 2.0: within every range rule
    raise AssertionError(f"add a non-default value for EngineArgs.{f.name} to TABLE")


def variants() -> list[dict]:
    """Field values, each field non-default in at least one variant. Some non-defaults
    exclude each other (tiers need the paged kv_manager and the prefix cache; priority
    needs continuous batching), so there are two files."""
    tiered = {f.name: non_default(f) for f in dataclasses.fields(EngineArgs)}
    for name in ("kv_manager", "enable_prefix_caching", "batching"):
        tiered[name] = EngineArgs.__dataclass_fields__[name].default
    plain = dict(tiered, kv_manager="buddy", enable_prefix_caching=False,
                 batching="length-bucket", scheduling_policy="fcfs",
                 preemption_mode="recompute", kv_offload_dir=None, warmup_prompts=None)
    return [tiered, plain]


def test_variants_cover_every_field():
    defaults = EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        assert any(v[f.name] != getattr(defaults, f.name) for v in variants()), f.name


def _same(name, got, want):
    if name == "speculative_config":
        return SpeculativeConfig.from_value(got) == SpeculativeConfig.from_value(want)
    return got == want and type(got) is type(want)


@pytest.mark.parametrize("variant", [0, 1], ids=["tiered", "plain"])
@pytest.mark.parametrize("spelling", ["underscored", "dashed"])
def test_every_engine_arg_round_trips(tmp_path, variant, spelling):
    values = variants()[variant]
    EngineArgs(**values)  # the variant is valid as Python arguments
    key = (lambda n: n.replace("_", "-")) if spelling == "dashed" else (lambda n: n)
    path = write(tmp_path, {key(n): v for n, v in values.items()})
    engine = EngineArgs.from_cli_args(parse("serve", "--config", path))
    for f in dataclasses.fields(EngineArgs):
        assert _same(f.name, getattr(engine, f.name), values[f.name]), \
            (f.name, getattr(engine, f.name), values[f.name])
    # generate has --model as an option rather than a positional: same result
    engine = EngineArgs.from_cli_args(parse("generate", "--config", path))
    for f in dataclasses.fields(EngineArgs):
        assert _same(f.name, getattr(engine, f.name), values[f.name]), f.name


# -- the offline API -------------------------------------------------------------------------

def test_engine_args_from_config_keeps_engine_keys(tmp_path):
    got = engine_args_from_config(write(tmp_path, MIXED))
    assert got == {"model": "/models/tuned", "max_num_seqs": 64, "max_num_batched_tokens": 4096,
                   "kv_cache_memory": "2GiB", "block_size": 32, "dtype": "float32",
                   "enable_prefix_caching": False, "bucket_window_s": 0.25}
    EngineArgs(**got)


@pytest.mark.parametrize("variant", [0, 1])
def test_engine_args_from_config_every_field(tmp_path, variant):
    values = variants()[variant]
    got = engine_args_from_config(write(tmp_path, {n.replace("_", "-"): v
                                                   for n, v in values.items()}))
    assert got == {n: v for n, v in values.items() if v is not None}
    assert EngineArgs(**got) == EngineArgs(**values)


def test_engine_args_from_config_errors(tmp_path):
    with pytest.raises(ConfigFileError, match="unknown key 'max_num_seq'.*'max_num_seqs'"):
        engine_args_from_config(write(tmp_path, {"max_num_seq": 1}))
    with pytest.raises(ConfigFileError, match="invalid int value: 'x'"):
        engine_args_from_config(write(tmp_path, {"block_size": "x"}))


def test_llm_takes_the_file(tmp_path, llama_dir):
    from kvserve import LLM, SamplingParams
    engine_keys = {"model": llama_dir, "max_num_seqs": 4, "num_kv_blocks": 32,
                   "enable_prefix_caching": False, "attention_backend": "torch"}
    path = write(tmp_path, engine_keys)
    with open(path) as f:
        assert yaml.safe_load(f) == load_config(path) == engine_keys
    params = SamplingParams(max_tokens=3, temperature=0.0)
    a = LLM(**load_config(path)).generate(["hello"], params, use_tqdm=False)
    served = write(tmp_path, dict({k.replace("_", "-"): v for k, v in engine_keys.items()},
                                  port=9000, host="0.0.0.0"), name="served.yaml")
    b = LLM(**engine_args_from_config(served)).generate(["hello"], params, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert len(a[0].outputs[0].token_ids) == 3
