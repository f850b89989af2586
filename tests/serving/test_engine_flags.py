"""The engine's flags come from one place: ``EngineConfig.add_flags``, read back by
``EngineConfig.from_args``, in both commands that run an engine (``jaxdecode serve`` and
``jaxdecode serve-bench``), with one spelling and one check each."""

import argparse
import dataclasses

import pytest

from jaxdecode.cli.app import build_parser, main
from jaxdecode.cli.common import UsageError
from jaxdecode.serving.config import FLAGS, EngineConfig

COMMANDS = ("serve", "serve-bench")
# a value other than the default for every flag, and the field it must reach
EVERY_FLAG = ["--slots", "6", "--cache", "paged", "--num-blocks", "40", "--block-size", "8",
              "--no-prefix-caching", "--attention", "portable", "--kv-dtype", "int8", "--prefill-chunk", "5",
              "--prefill-budget", "7", "--decode-steps", "3", "--no-overlap", "--admit-batch", "2"]
EXPECTED = EngineConfig(slots=6, cache="paged", num_blocks=40, block_size=8, prefix_caching=False,
                        attention="portable", kv_dtype="int8", prefill_chunk=5, prefill_budget=7, decode_steps=3,
                        overlap=False, admit_batch=2)
# the speculative engine's flags (the dense float32 cache only: apart from the list above)
SPECULATIVE = {"speculative", "draft", "gamma", "speculative_max_rows"}
EVERY_SPECULATIVE_FLAG = ["--speculative", "model", "--draft", "small", "--gamma", "3", "--speculative-max-rows", "2"]
EXPECTED_SPECULATIVE = EngineConfig(slots=1, speculative="model", draft="small", gamma=3, speculative_max_rows=2)


def _config(command: str, argv: list[str]) -> EngineConfig:
    return EngineConfig.from_args(build_parser().parse_args([command, *argv]))


def _engine_options(command: str) -> set[str]:
    sub = next(a for a in build_parser()._subparsers._group_actions if isinstance(a, argparse._SubParsersAction))
    group = next(g for g in sub.choices[command]._action_groups if g.title == "engine")
    return {s for a in group._group_actions for s in a.option_strings}


@pytest.mark.quick
@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_but_the_policy_has_one_flag(command):
    assert set(FLAGS) == {f.name for f in dataclasses.fields(EngineConfig)} - {"policy"}
    assert _config(command, EVERY_FLAG) == EXPECTED
    for f in FLAGS:  # each flag alone moves its own field and no other
        every, expected = (EVERY_SPECULATIVE_FLAG, EXPECTED_SPECULATIVE) if f in SPECULATIVE else (EVERY_FLAG, EXPECTED)
        at = next(i for i, a in enumerate(every) if a.lstrip("-").replace("-", "_").removeprefix("no_") == f)
        flag = every[at:at + (1 if at + 1 == len(every) or every[at + 1].startswith("--") else 2)]
        extra = ["--cache", "paged"] if f == "num_blocks" else ["--slots", "6"] if f == "admit_batch" else \
            ["--speculative", "model"] if f in SPECULATIVE - {"speculative"} else []
        got = _config(command, extra + flag)
        assert getattr(got, f) == getattr(expected, f), f
        moved = {g for g in FLAGS if getattr(got, g) != getattr(_config(command, extra), g)}
        assert moved == {f}, (f, moved)


@pytest.mark.quick
def test_both_commands_take_the_same_flags_and_no_other_spelling():
    assert _engine_options("serve") == _engine_options("serve-bench") == {
        "--slots", "--cache", "--num-blocks", "--block-size", "--no-prefix-caching", "--attention", "--kv-dtype",
        "--prefill-chunk", "--prefill-budget", "--decode-steps", "--no-overlap", "--admit-batch", "--speculative",
        "--draft", "--gamma", "--speculative-max-rows"}
    argv = ["--slots", "4", "--cache", "paged", "--block-size", "4", "--admit-batch", "2", "--no-overlap"]
    assert _config("serve", argv) == _config("serve-bench", argv)
    # the command's own default slot count; everything else the same
    assert _config("serve", []) == dataclasses.replace(_config("serve-bench", []), slots=32)
    for command in COMMANDS:
        with pytest.raises(UsageError, match="unrecognized arguments: --paged"):
            build_parser().parse_args([command, "--paged"])


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flags, message", [
    (["--slots", "0"], "--slots must be an integer >= 1, got 0"),
    (["--slots", "2", "--admit-batch", "3"], "--admit-batch must be at most the --slots (2), got 3"),
    (["--num-blocks", "4"], "--num-blocks is a setting of the paged cache (--cache 'paged')"),
    (["--decode-steps", "0"], "--decode-steps must be an integer >= 1, got 0"),
    (["--gamma", "2"], "--gamma is a setting of speculative decoding (--speculative)"),
    (["--speculative", "lookup", "--cache", "paged"], "speculative decoding in the engine runs on the dense "
                                                      "float32 cache: drop --cache 'paged'"),
])
def test_a_bad_value_is_one_line_naming_its_flag(command, flags, message, capsys, tiny_ckpt):
    """Checked once, by EngineConfig, before a model is loaded or a server started."""
    assert main([command, "--ckpt", tiny_ckpt, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"jaxdecode: error: {message}", err


def test_python_callers_keep_the_field_names():
    with pytest.raises(ValueError, match=r"^admit_batch must be at most the slots \(2\), got 3$"):
        EngineConfig(2, admit_batch=3)
    with pytest.raises(ValueError, match=r"^num_blocks is a setting of the paged cache \(cache 'paged'\)$"):
        EngineConfig(2, num_blocks=3)
