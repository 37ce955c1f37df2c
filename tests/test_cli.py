"""The ``jserve`` command: streamed text equals the offline API's, bad input exits 2, and
``convert`` writes a checkpoint that loads with the same outputs."""
from __future__ import annotations

from jserve import SamplingParams
from jserve.cli import main
from llm_helpers import small_llm

SMALL_FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "512"]


def test_generate_streams_the_offline_result(capsys, llm):
    assert main(["generate", "--model", "default", *SMALL_FLAGS, "--max-tokens", "12",
                 "--ignore-eos", "Hello, jserve"]) == 0
    streamed = capsys.readouterr()
    expected = llm.generate("Hello, jserve", SamplingParams(temperature=0.0, max_tokens=12,
                                                            ignore_eos=True))[0]
    assert streamed.out == expected.text + "\n"
    assert "[12 tokens, finish_reason=length]" in streamed.err


def test_generate_rejects_bad_input_with_exit_code_2(capsys):
    assert main(["generate", "--model", "default", *SMALL_FLAGS, "--temperature", "-1",
                 "hi"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_convert_round_trip(tmp_path, capsys, llm):
    out = tmp_path / "ckpt"
    assert main(["convert", "--model", "default", "--out", str(out)]) == 0
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    restored = small_llm(str(out)).generate("abc", params)[0]
    assert restored.text == llm.generate("abc", params)[0].text


def test_every_flag_says_what_it_does_and_its_default():
    import argparse

    from jserve.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        formatter = p._get_formatter()
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, (name, action.option_strings or action.dest)
            if action.option_strings:  # tokens name the environment variable instead
                shown = formatter._get_help_string(action)
                assert "%(default)" in shown or "(default: $JSERVE_" in shown, (name, action)
    serve, generate = sub.choices["serve"], sub.choices["generate"]
    # --warmup MODE: all for a server (every program before ready), none for one completion.
    assert serve.parse_args([]).warmup == "all" and generate.parse_args(["x"]).warmup == "none"
    assert serve.parse_args(["--no-warmup"]).warmup == "none"
    assert serve.parse_args(["--warmup"]).warmup == "all"
    assert serve.format_help().count("--no-warmup") == 2  # the usage line and the flag's


def test_the_iteration_budget_keeps_its_old_flag_deprecated(capsys):
    from jserve.cli import build_parser
    parser = build_parser()
    for command in (["serve"], ["simulate", "--trace", "t", "--policy", "lars", "--out", "o"]):
        new = parser.parse_args(command + ["--iteration-budget", "0.07"])
        assert new.iteration_budget == 0.07 and "deprecated" not in capsys.readouterr().err
        old = parser.parse_args(command + ["--tpot-slo", "0.08"])
        assert old.iteration_budget == 0.08
        assert "--tpot-slo is deprecated; use --iteration-budget" in capsys.readouterr().err
        assert parser.parse_args(command).iteration_budget == 0.05


def test_ray_replicas_get_the_engine_arguments_serve_builds_with(monkeypatch):
    """``--ray`` hands each replica the ``LLM`` arguments the in-process engine gets
    (``commands.llm_kwargs``: quantization, the scheduler's knobs, generation config)."""
    from jserve.serving import ray_app
    got = {}
    monkeypatch.setattr(ray_app, "run", lambda args, host, port, ready=None:
                        got.update(args) or 0)
    assert main(["serve", "--ray", "--quantization", "int8", "--scheduler", "sprpt",
                 "--sprpt-c", "0.5", "--generation-config", "vllm"]) == 0
    engine = got["engine"]
    assert (engine["quantization"], engine["scheduler"], engine["sprpt_c"]) == (
        "int8", "sprpt", 0.5)
    assert engine["generation_config"] == "vllm" and engine["dtype"] == "auto"
