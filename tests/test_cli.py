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
