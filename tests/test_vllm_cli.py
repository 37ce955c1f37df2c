"""vLLM's command line on ``jserve serve`` (docs/compatibility.md): its spellings parse to
jserve's settings, the flags jserve cannot honour are refused naming themselves, ``--dtype
auto`` runs a bf16 checkpoint in float32 on CPU and says so, and a whole vLLM command line
serves the OpenAI API on ``--port`` behind ``--api-key``."""
from __future__ import annotations

import argparse
import socket

import httpx2 as httpx
import pytest

from conftest import Served
from jserve.cli import build_parser, main
from jserve.serving.commands import VLLM_REFUSED, read_chat_template, vllm_args

KEY = "k3y"


def _serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_vllm_spellings_parse_to_jserve_settings():
    from jserve.flags.args import engine_kwargs

    a = _serve_args("some/dir", "--port", "8123", "--tensor-parallel-size", "2",
                    "--gpu-memory-utilization", "0.5", "--api-key", KEY, "--seed", "7",
                    "--enable-prefix-caching", "--kv-cache-dtype", "fp8", "--max-logprobs", "20",
                    "--trust-remote-code", "--tool-call-parser", "llama3_json",
                    "--enable-auto-tool-choice", "--num-gpu-blocks-override", "64",
                    "--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem", "--block-size", "32",
                    "--swap-space", "2.5", "--reasoning-parser", "deepseek_r1")
    assert (a.http_port, a.grpc_port, a.auth_token, a.seed) == (8123, 50051, KEY, 7)
    assert (a.tls_cert, a.tls_key, a.dtype) == ("c.pem", "k.pem", "auto")
    kw = engine_kwargs(a)
    assert kw["mesh"] == "tp=2" and kw["memory_fraction"] == 0.5
    assert kw["kv_cache_dtype"] == "fp8_e4m3" and kw["num_kv_pages"] == 64
    assert kw["enable_prefix_caching"] is True
    assert (kw["page_size"], kw["swap_space_bytes"], a.reasoning_parser) == (
        32, 5 << 29, "deepseek_r1")
    unset = engine_kwargs(_serve_args())  # EngineConfig's own defaults then hold
    assert "page_size" not in unset and "swap_space_bytes" not in unset
    assert engine_kwargs(_serve_args("--no-enable-prefix-caching"))["enable_prefix_caching"] \
        is False
    assert vllm_args(a) is None and a.model == "some/dir"  # the positional model
    # jserve's own spellings still work: --http-port is the new --port's alias, --model stays.
    b = _serve_args("--model", "other", "--http-port", "9000", "--grpc-port", "0",
                    "--memory-fraction", "0.3", "--mesh", "kvp=2,spp=2", "-tp", "2")
    assert (b.http_port, b.grpc_port, b.model_tag) == (9000, 0, None)
    vllm_args(b)
    assert b.model == "other"
    assert engine_kwargs(b)["mesh"] == "spp=2,kvp=2,tp=2"
    defaults = _serve_args()
    assert (defaults.http_port, defaults.grpc_port, defaults.model) == (8000, 50051, "default")
    sub = next(x for x in build_parser()._actions if isinstance(x, argparse._SubParsersAction))
    help_text = sub.choices["serve"].format_help()
    for flag in ("MODEL", "--port", "--grpc-port", "--tensor-parallel-size",
                 "--gpu-memory-utilization", "--api-key", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--seed", "--max-logprobs", "--tokenizer",
                 "--trust-remote-code", "--kv-cache-dtype", "--chat-template",
                 "--tool-call-parser", "--enable-auto-tool-choice"):
        assert flag in help_text, flag


@pytest.mark.parametrize("argv, named", [
    (["--mesh", "tp=4", "--tensor-parallel-size", "2"], "--tensor-parallel-size 2"),
    (["--tokenizer", "/elsewhere"], "--tokenizer /elsewhere"),
    (["--chat-template", "{{ messages }}"], "--chat-template"),   # the byte tokenizer has none
    (["dir-a", "--model", "dir-b"], "given twice"),
])
def test_vllm_values_jserve_cannot_honour_are_refused_before_loading(argv, named, capsys):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert named in err and "error" in err, err


@pytest.mark.parametrize("argv, named", [
    (["--max-logprobs", "21"], "--max-logprobs"),
    (["--max-logprobs", "-1"], "--max-logprobs"),
    (["--tool-call-parser", "qwen3_coder"], "--tool-call-parser"),  # XML, not hermes
    (["--kv-cache-dtype", "fp8_inc"], "--kv-cache-dtype"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    (["--dtype", "half"], "--dtype"),
    (["--no-such-vllm-flag"], "--no-such-vllm-flag"),
    *[([flag, "1"], flag) for flag in VLLM_REFUSED],
])
def test_every_refused_vllm_flag_is_named(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert named in err, err
    if named in VLLM_REFUSED:
        assert f"{named}: vLLM's flag is not supported by jserve: {VLLM_REFUSED[named]}" in err


def test_refused_flags_and_other_unknown_ones_are_all_named(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--enforce-eager", "--cpu-offload-gb=4", "--bogus"])
    err = capsys.readouterr().err
    assert "--enforce-eager: vLLM's flag" in err and "--cpu-offload-gb: vLLM's flag" in err
    assert "unrecognized arguments: --bogus" in err


def test_auto_dtype_is_float32_for_a_bf16_checkpoint_on_cpu():
    from hf_models import tiny_llama_dir
    from jserve.config import auto_dtype
    from jserve.model.weights import load_config, resolve_dtype

    assert auto_dtype("bfloat16", "cpu") == ("float32", "auto: bf16 checkpoint, CPU backend")
    assert auto_dtype("bfloat16", "gpu")[0] == "bfloat16"  # accelerators keep bf16
    assert auto_dtype("float16", "tpu")[0] == "bfloat16"
    assert auto_dtype("float32", "gpu")[0] == "float32"
    bf16 = str(tiny_llama_dir("llama2", dtype="bfloat16"))
    assert resolve_dtype(bf16, "auto") == ("float32", "auto: bf16 checkpoint, CPU backend")
    assert resolve_dtype(bf16, "auto", backend="gpu")[0] == "bfloat16"
    assert load_config(bf16, "auto").dtype == "float32"
    assert load_config(bf16).dtype == "bfloat16"  # None: as stored
    assert resolve_dtype(bf16, "bfloat16") == ("bfloat16", "as asked")
    assert resolve_dtype("default", "auto") == ("float32", "auto: f32 built-in model")


def test_a_chat_template_is_a_file_or_the_template_itself(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert read_chat_template(str(f)) == f.read_text()
    assert read_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ValueError, match="--chat-template 'no/such.jinja': no such file"):
        read_chat_template("no/such.jinja")
    with pytest.raises(ValueError, match="--chat-template: not a Jinja template"):
        read_chat_template("{% for %}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_vllm_command_line_serves_the_openai_api_on_port_behind_the_api_key():
    """`jserve serve DIR --port P --tensor-parallel-size 1 --gpu-memory-utilization 0.5
    --api-key K --seed 0` on a bf16 checkpoint: the OpenAI API on P, 401 without K, a
    completion with it; float32 on CPU, said on the first line; gRPC on --grpc-port;
    --chat-template's template is the one chat requests are rendered with."""
    from hf_models import tiny_llama_dir
    from jserve.client import Client
    from jserve.tokenizer import HFTokenizer

    model = tiny_llama_dir("llama2", dtype="bfloat16", with_tokenizer=True)
    port = _free_port()
    s = Served(str(model), "--port", str(port), "--tensor-parallel-size", "1",
               "--gpu-memory-utilization", "0.5", "--api-key", KEY, "--seed", "0",
               "--trust-remote-code", "--enable-auto-tool-choice",
               "--tool-call-parser", "llama3_json", "--max-logprobs", "20",
               "--chat-template", "{{ bos_token }}fixed prompt")
    try:
        assert s.url == f"http://127.0.0.1:{port}", s.line
        assert "dtype float32 (auto: bf16 checkpoint, CPU backend)" in s.line, s.line
        body = {"model": model.name, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code == 401
        wrong = {"authorization": "Bearer nope"}
        assert httpx.post(s.url + "/v1/completions", json=body, headers=wrong,
                          timeout=60).status_code == 401
        auth = {"authorization": f"Bearer {KEY}"}
        r = httpx.post(s.url + "/v1/completions", json=body, headers=auth, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        # The chat template replaced the tokenizer's: every chat is the same fixed prompt.
        want = len(HFTokenizer(model).encode("<s>fixed prompt", add_special_tokens=False))
        for text in ("hi", "a much longer message than the other one"):
            chat = {"model": model.name, "max_tokens": 1,
                    "messages": [{"role": "user", "content": text}]}
            r = httpx.post(s.url + "/v1/chat/completions", json=chat, headers=auth, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == want
        with Client(s.target, auth_token=KEY) as c:  # gRPC moved to --grpc-port
            assert c.model_info().served_model_names == [model.name]
    finally:
        s.stop()
