"""ServerArgs: CLI parsing, validation errors, and the CUDA-graph resolution rules (DESIGN §6)."""

import json
import os
import tempfile
import unittest
from types import SimpleNamespace
from unittest import mock

import pytest

from sglang.srt.configs.cuda_graph_config import (
    Backend,
    CudaGraphConfig,
    PhaseConfig,
    decode_bucket_ladder,
    prefill_bucket_ladder,
)
from sglang.srt.server_args import LoRAPathSpec, ServerArgs, prepare_server_args


def _model_config_stub():
    return SimpleNamespace(
        hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]),
        is_piecewise_cuda_graph_disabled_model=False,
        is_multimodal=False,
        is_multimodal_piecewise_cuda_graph_supported=False,
    )


def _handled_args(**overrides) -> ServerArgs:
    """ServerArgs resolved as if on a CUDA machine."""
    args = ServerArgs(model_path="dummy", **overrides)
    args.model_config = _model_config_stub()
    with mock.patch("sglang.srt.utils.is_cuda", return_value=True):
        args._handle_cuda_graph_config()
    return args


class TestPrefillCudaGraphLoRACompatibility(unittest.TestCase):
    """LoRA no longer turns the breakable prefill graph off; it still turns tc_piecewise off.

    Guards the GPU end-to-end test against a rule that silently re-disables the graph (which would
    make every graph-vs-eager comparison pass vacuously).
    """

    def test_enable_lora_keeps_breakable_prefill_graph(self):
        args = _handled_args(enable_lora=True, max_lora_rank=8, lora_target_modules=["all"])
        self.assertEqual(args.cuda_graph_config.prefill.backend, Backend.BREAKABLE)
        self.assertEqual(args.cuda_graph_config.decode.backend, Backend.FULL)

    def test_lora_paths_keep_breakable_prefill_graph(self):
        args = _handled_args(lora_paths=["dummy/lora-adapter"])
        self.assertTrue(args.enable_lora)
        self.assertEqual(args.cuda_graph_config.prefill.backend, Backend.BREAKABLE)

    def test_lora_still_disables_tc_piecewise_prefill_graph(self):
        args = ServerArgs(model_path="dummy", enable_lora=True, max_lora_rank=8, lora_target_modules=["all"])
        args.model_config = _model_config_stub()
        args.cuda_graph_config = CudaGraphConfig(prefill=PhaseConfig(backend=Backend.TC_PIECEWISE))
        patches = [
            mock.patch(f"sglang.srt.server_args.{name}", return_value=False)
            for name in ("is_hip", "is_npu", "is_cpu", "is_mps", "is_xpu")
        ]
        for p in patches:
            p.start()
        try:
            args._disable_tc_piecewise_cudagraph_if_incompatible()
        finally:
            for p in patches:
                p.stop()
        self.assertEqual(args.cuda_graph_config.prefill.backend, Backend.DISABLED)

    def test_tc_piecewise_without_lora_survives_the_rule(self):
        args = ServerArgs(model_path="dummy")
        args.cuda_graph_config = CudaGraphConfig(prefill=PhaseConfig(backend=Backend.TC_PIECEWISE))
        with mock.patch("sglang.srt.server_args.is_cpu", return_value=False):
            args._disable_tc_piecewise_cudagraph_if_incompatible()
        self.assertEqual(args.cuda_graph_config.prefill.backend, Backend.TC_PIECEWISE)

    def test_explicit_prefill_backend_skips_auto_disabling(self):
        args = _handled_args(enable_lora=True, max_lora_rank=8, lora_target_modules=["all"],
                             cuda_graph_backend_prefill="tc_piecewise")
        self.assertEqual(args.cuda_graph_config.prefill.backend, Backend.TC_PIECEWISE)
        self.assertIn(("prefill", "backend"), args._cuda_graph_config_locked)

    def test_full_prefill_backend_with_lora_is_kept(self):
        args = _handled_args(lora_paths=["a=/x"], cuda_graph_backend_prefill="full")
        self.assertEqual(args.cuda_graph_config.prefill.backend, Backend.FULL)


class TestCudaGraphResolution(unittest.TestCase):
    def test_defaults_without_cuda_are_disabled(self):
        with mock.patch("sglang.srt.utils.is_cuda", return_value=False):
            args = ServerArgs(model_path="dummy")
        self.assertEqual(args.cuda_graph_config.prefill.backend, Backend.DISABLED)
        self.assertEqual(args.cuda_graph_config.decode.backend, Backend.DISABLED)

    def test_device_cpu_disables_graphs_on_a_cuda_machine(self):
        with mock.patch("sglang.srt.utils.is_cuda", return_value=True):
            args = ServerArgs(model_path="dummy", device="cpu")
        self.assertEqual(args.cuda_graph_config.prefill.backend, Backend.DISABLED)

    def test_precedence_json_over_flags_over_disable_switches(self):
        args = _handled_args(
            disable_cuda_graph=True,
            cuda_graph_backend_decode="breakable",
            cuda_graph_max_bs_prefill=512,
            cuda_graph_config=json.dumps({"prefill": {"backend": "full", "max_bs": 256}}),
        )
        cfg = args.cuda_graph_config
        self.assertEqual(cfg.decode.backend, Backend.BREAKABLE)  # flag beats legacy switch
        self.assertEqual(cfg.prefill.backend, Backend.FULL)  # JSON beats legacy switch
        self.assertEqual(cfg.prefill.max_bs, 256)  # JSON beats flag

    def test_per_phase_disable(self):
        args = _handled_args(disable_prefill_cuda_graph=True)
        self.assertEqual(args.cuda_graph_config.prefill.backend, Backend.DISABLED)
        self.assertEqual(args.cuda_graph_config.decode.backend, Backend.FULL)
        args = _handled_args(disable_decode_cuda_graph=True)
        self.assertEqual(args.cuda_graph_config.decode.backend, Backend.DISABLED)
        self.assertEqual(args.cuda_graph_config.prefill.backend, Backend.BREAKABLE)

    def test_explicit_buckets(self):
        args = _handled_args(cuda_graph_bs_prefill=[64, 16, 16], cuda_graph_bs_decode=[4, 1])
        self.assertEqual(args.cuda_graph_config.prefill.bs, [16, 64])
        self.assertEqual(args.cuda_graph_config.decode.bs, [1, 4])

    def test_bad_json(self):
        for bad, needle in (
            ("{not json", "not valid JSON"),
            ('{"middle": {}}', "unknown phase"),
            ('{"prefill": {"backend": "breakable", "speed": 1}}', "unknown key"),
            ('{"decode": {"backend": "tc_piecewise"}}', "not allowed for the decode phase"),
            ('{"prefill": {"backend": "warp"}}', "warp"),
            ('{"prefill": {"backend": "tc_piecewise", "compile_mode": "fastest"}}', "compile_mode must be one of"),
        ):
            with self.subTest(bad=bad), self.assertRaisesRegex(ValueError, needle):
                ServerArgs(model_path="dummy", cuda_graph_config=bad)

    def test_tc_piecewise_compile_mode(self):
        args = ServerArgs(model_path="dummy", cuda_graph_config=(
            '{"prefill": {"backend": "tc_piecewise", "compile_mode": "max-autotune"}}'))
        self.assertEqual(args.cuda_graph_config.prefill.compile_mode, "max-autotune")
        self.assertEqual(args.cuda_graph_config.to_dict()["prefill"]["compile_mode"], "max-autotune")

    def test_bucket_ladders(self):
        ladder = prefill_bucket_ladder(1024)
        self.assertEqual(ladder[-1], 1024)
        self.assertEqual(ladder, sorted(set(ladder)))
        self.assertEqual(prefill_bucket_ladder(100)[-1], 100)
        self.assertEqual(decode_bucket_ladder(32)[:5], [1, 2, 4, 8, 12])
        self.assertEqual(decode_bucket_ladder(33)[-1], 33)


class TestValidation(unittest.TestCase):
    def test_constructs_without_touching_files(self):
        args = ServerArgs(model_path="dummy")
        self.assertEqual(args.model_path, "dummy")
        self.assertFalse(args.enable_lora)

    def test_every_validation_error_names_the_flag(self):
        cases = [
            (dict(load_format="pt"), "--load-format"),
            (dict(dtype="int8"), "--dtype"),
            (dict(device="tpu"), "--device"),
            (dict(log_level="loud"), "--log-level"),
            (dict(attention_backend="flashinfer"), "--attention-backend"),
            (dict(lora_backend="ascend"), "--lora-backend"),
            (dict(lora_eviction_policy="random"), "--lora-eviction-policy"),
            (dict(max_lora_chunk_size=48), "--max-lora-chunk-size"),
            (dict(mem_fraction_static=1.5), "--mem-fraction-static"),
            (dict(mem_fraction_static=0.0), "--mem-fraction-static must be in (0, 1]"),
            (dict(mem_fraction_static=1.0), None),
            (dict(context_length=0), "--context-length"),
            (dict(max_total_tokens=-5), "--max-total-tokens"),
            (dict(max_running_requests=0), "--max-running-requests"),
            (dict(max_prefill_tokens=0), "--max-prefill-tokens"),
            (dict(chunked_prefill_size=0), "--chunked-prefill-size"),
            (dict(port=70000), "--port"),
            (dict(served_model_name="a:b"), "--served-model-name"),
            (dict(served_model_name=" "), "--served-model-name must not be empty"),
            (dict(cuda_graph_config='{"prefill": {"backend": "nonsense"}}'), "--cuda-graph-config"),
            (dict(max_loras_per_batch=0), "--max-loras-per-batch"),
            (dict(enable_lora=True, max_lora_rank=0, lora_target_modules=["all"]), "--max-lora-rank"),
            (dict(enable_lora=True), "--max-lora-rank and --lora-target-modules"),
            (dict(enable_lora=True, max_lora_rank=8), "--lora-target-modules"),
            (dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj", "all"]), "'all' must be given alone"),
            (dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["lm_head"]), "--lora-target-modules"),
            (dict(lora_paths=["a=/x"], max_loaded_loras=2, max_loras_per_batch=8), "--max-loaded-loras"),
            (dict(lora_paths=["a=/x", "b=/y", "c=/z"], max_loaded_loras=8, max_loras_per_batch=8), None),
            (dict(lora_paths=["a=/x", "a=/y"]), "duplicate adapter name"),
            (dict(lora_resolver_dir="/no/such/folder"), "--lora-resolver-dir '/no/such/folder' is not a directory"),
            (dict(lora_resolver_dir="/tmp"), "--max-lora-rank and --lora-target-modules"),  # implies --enable-lora
            (dict(lora_resolver_dir="/tmp", max_lora_rank=8, lora_target_modules=["all"]), None),
            (dict(lora_resolver_dir="/tmp", enable_lora=False), "--lora-resolver-dir needs LoRA"),
            (dict(lora_paths=['{"lora_name": "a"}']), "lora_path"),
            (dict(lora_paths=['{"lora_path": "/a", "rank": 3}']), "unknown key"),
            (dict(lora_paths=['{"lora_name": "a", "lora_path": "/a", "pinned": true}'], max_loras_per_batch=1), "pinned"),
            (dict(cuda_graph_backend_prefill="fast"), "--cuda-graph-backend-prefill"),
            (dict(cuda_graph_backend_decode="tc_piecewise"), "--cuda-graph-backend-decode"),
            (dict(cuda_graph_max_bs_prefill=0), "--cuda-graph-max-bs-prefill"),
            (dict(cuda_graph_bs_decode=[0]), "--cuda-graph-bs-decode"),
            (dict(tool_call_parser="gorilla"), "--tool-call-parser must be one of ['qwen25'"),
            (dict(reasoning_parser="deepseek_r1"), "--reasoning-parser must be one of ['qwen3'"),
            (dict(tool_call_parser="llama3", reasoning_parser="deepseek-r1"), None),
        ]
        for kwargs, needle in cases:
            with self.subTest(kwargs=kwargs):
                if needle is None:
                    ServerArgs(model_path="dummy", **kwargs)  # valid
                    continue
                with self.assertRaises(ValueError) as ctx:
                    ServerArgs(model_path="dummy", **kwargs)
                self.assertIn(needle, str(ctx.exception))

    def test_a_relative_resolver_dir_becomes_absolute(self):
        import os
        import tempfile
        with tempfile.TemporaryDirectory() as root:
            os.mkdir(os.path.join(root, "adapters"))
            here = os.getcwd()
            os.chdir(root)
            try:
                args = ServerArgs(model_path="dummy", lora_resolver_dir="adapters", max_lora_rank=8,
                                  lora_target_modules=["all"])
            finally:
                os.chdir(here)
            self.assertEqual(args.lora_resolver_dir, os.path.join(os.path.realpath(root), "adapters"))

    def test_choice_errors_list_the_allowed_values(self):
        with self.assertRaises(ValueError) as ctx:
            ServerArgs(model_path="dummy", lora_backend="ascend")
        for allowed in ("csgmv", "triton", "torch_native"):
            self.assertIn(allowed, str(ctx.exception))


class TestFlagsWithoutEffectOnCPU(unittest.TestCase):
    """GPU-only flags are accepted on a CPU, with a warning instead of silence."""

    def _warnings(self, **kwargs) -> str:
        with self.assertLogs("sglang.srt.server_args", level="WARNING") as logs:
            ServerArgs(model_path="dummy", device="cpu", **kwargs)
        return "\n".join(logs.output)

    def test_memory_fraction_and_graph_flags_warn(self):
        self.assertIn("--mem-fraction-static has no effect on a CPU", self._warnings(mem_fraction_static=0.5))
        out = self._warnings(cuda_graph_max_bs_decode=64, cuda_graph_bs_prefill=[128])
        self.assertIn("--cuda-graph-max-bs-decode, --cuda-graph-bs-prefill have no effect", out)

    def test_defaults_and_disabling_flags_say_nothing(self):
        with self.assertNoLogs("sglang.srt.server_args", level="WARNING"):
            ServerArgs(model_path="dummy", device="cpu", disable_cuda_graph=True)


class TestCli(unittest.TestCase):
    def test_lora_paths_forms(self):
        args = prepare_server_args([
            "--model-path", "dummy",
            "--lora-paths", "/adapters/plain", "sql=/adapters/sql",
            '{"lora_name": "chat", "lora_path": "/adapters/chat", "pinned": true}',
            "--max-loras-per-batch", "4",
        ])
        self.assertTrue(args.enable_lora)
        self.assertEqual(
            args.lora_paths,
            [
                LoRAPathSpec("/adapters/plain", "/adapters/plain", False),
                LoRAPathSpec("sql", "/adapters/sql", False),
                LoRAPathSpec("chat", "/adapters/chat", True),
            ],
        )

    def test_lora_paths_entries_with_an_empty_name_or_an_equals_sign_in_a_folder(self):
        # "=PATH" and an empty JSON name were served under the path as the name, while "x=" was
        # refused: an empty name is refused in every form.
        for entry in ("=/adapters/a", '{"lora_name": "", "lora_path": "/adapters/a"}', "x="):
            with self.assertRaisesRegex(ValueError, "empty name or path"):
                LoRAPathSpec.parse(entry)
        self.assertEqual(LoRAPathSpec.parse('{"lora_name": null, "lora_path": "/a"}'), LoRAPathSpec("/a", "/a"))
        # A bare path whose folder name holds "=" (which exists) is that folder, not NAME=PATH.
        with tempfile.TemporaryDirectory() as tmp:
            folder = os.path.join(tmp, "lr=1e-4")
            os.mkdir(folder)
            self.assertEqual(LoRAPathSpec.parse(folder), LoRAPathSpec(folder, folder))
            self.assertEqual(LoRAPathSpec.parse(f"n={folder}"), LoRAPathSpec("n", folder))

    def test_a_hub_id_as_model_path_is_told_that_nothing_downloads(self):
        from sglang.srt.server_configs import resolve_model

        with self.assertRaisesRegex(ValueError, "Hub id: this server downloads nothing"):
            resolve_model(prepare_server_args(["--model-path", "Qwen/Qwen3-4B"]))
        with self.assertRaises(ValueError) as e:
            resolve_model(prepare_server_args(["--model-path", "/no/such/folder"]))
        self.assertNotIn("Hub id", str(e.exception))

    def test_defaults_match_the_design(self):
        args = prepare_server_args([])
        self.assertEqual(args.model_path, "demo")
        self.assertIsNone(args.max_loras_per_batch)  # sized at start: lora/pool_sizing.py
        self.assertEqual(args.lora_backend, "csgmv")
        self.assertEqual(args.lora_eviction_policy, "lru")
        self.assertEqual(args.max_lora_chunk_size, 16)
        self.assertIsNone(args.enable_lora or None)
        # Fused where the module is folded: the H200 measured the same logprobs as unfused.
        self.assertEqual(args.lora_fuse_norm, "auto")

    def test_overlap_schedule_flags_reach_the_scheduler_config(self):
        from sglang.srt.server_configs import build_run_configs

        for flags, on in (([], False), (["--enable-overlap-schedule"], True), (["--disable-overlap-schedule"], False),
                          (["--enable-overlap-schedule", "--disable-overlap-schedule"], False)):
            args = prepare_server_args(["--model-path", "demo", "--device", "cpu", *flags])
            self.assertEqual(build_run_configs(args).scheduler.overlap_schedule, on, flags)
        # Unset, it follows the machine: on for a single-GPU CUDA server, off on the CPU and under
        # tensor parallelism; --disable-overlap-schedule always wins.
        for flags, on in ((["--device", "cuda"], True), (["--device", "cpu"], False),
                          (["--device", "cuda", "--tp-size", "2"], False),
                          (["--device", "cuda", "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:5000"], False),
                          (["--device", "cuda", "--disable-overlap-schedule"], False),
                          (["--device", "cuda", "--tp-size", "2", "--enable-overlap-schedule"], True)):
            args = prepare_server_args(["--model-path", "demo", *flags])
            self.assertEqual(args.resolved_overlap_schedule(), on, flags)

    def test_lora_fuse_norm_reaches_the_run_config(self):
        from sglang.srt.server_configs import build_run_configs

        common = ["--model-path", "demo", "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all"]
        for flags, mode in ((["--lora-fuse-norm"], "on"), (["--lora-fuse-norm", "off"], "off"), ([], "auto")):
            args = prepare_server_args(common + flags)
            self.assertEqual(args.lora_fuse_norm, mode)
            self.assertEqual(build_run_configs(args).scheduler.runner.lora.fuse_norm, mode)
        with self.assertRaises(SystemExit):  # argparse's choices
            prepare_server_args(common + ["--lora-fuse-norm", "sometimes"])
        # The Python API's bool form, and a bad value with the flag's name in the message.
        self.assertEqual(ServerArgs(model_path="demo", lora_fuse_norm=True).lora_fuse_norm, "on")
        with self.assertRaisesRegex(ValueError, "--lora-fuse-norm"):
            ServerArgs(model_path="demo", lora_fuse_norm="sometimes")

    def test_a_vllm_flag_is_refused_with_ours_named(self):
        import contextlib
        import io

        def refusal(*flags: str) -> str:
            err = io.StringIO()
            with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as exit_:
                prepare_server_args(["--model-path", "demo", *flags])
            self.assertEqual(exit_.exception.code, 2)
            return err.getvalue()

        text = refusal("--lora-modules", "sql=/adapters/sql", "--max-model-len=4096")
        self.assertIn("--lora-modules is vLLM's flag: here, use --lora-paths", text)
        self.assertIn("--max-model-len is vLLM's flag: here, use --context-length", text)
        self.assertNotIn("vLLM", refusal("--no-such-flag"))
        # A vLLM flag that is a prefix of ours is that flag (argparse's abbreviations).
        self.assertEqual(prepare_server_args(["--model-path", "demo", "--max-loras", "4"]).max_loras_per_batch, 4)

    def test_grammar_backend_flag_reaches_both_processes_configs(self):
        from sglang.srt.constrained.base import xgrammar_available
        from sglang.srt.server_configs import build_run_configs

        default = "xgrammar" if xgrammar_available() else "none"
        for flags, backend in (([], default), (["--grammar-backend", "none"], "none")):
            configs = build_run_configs(prepare_server_args(["--model-path", "demo", "--device", "cpu", *flags]))
            self.assertEqual(configs.scheduler.grammar_backend, backend, flags)
            self.assertEqual(configs.tokenizer_manager.grammar_backend, backend, flags)
            self.assertEqual(configs.tokenizer_manager.public_args["grammar_backend"], backend, flags)
        with self.assertRaises(SystemExit):  # argparse's choices
            prepare_server_args(["--grammar-backend", "outlines"])
        with self.assertRaisesRegex(ValueError, "--grammar-backend must be one of"):
            ServerArgs(model_path="demo", grammar_backend="outlines")

    def test_graph_flags_parse(self):
        args = prepare_server_args([
            "--cuda-graph-backend-prefill", "full", "--cuda-graph-max-bs-prefill", "1024",
            "--cuda-graph-bs-decode", "1", "2", "8", "--disable-radix-cache",
        ])
        self.assertEqual(args.cuda_graph_config.prefill.backend, Backend.FULL)
        self.assertEqual(args.cuda_graph_config.prefill.max_bs, 1024)
        self.assertEqual(args.cuda_graph_config.decode.bs, [1, 2, 8])

    def test_bad_cli_choice_exits(self):
        with pytest.raises(SystemExit):
            prepare_server_args(["--lora-backend", "nope"])

    def test_help_says_what_disable_radix_cache_turns_off(self):
        import argparse

        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        self.assertIn("--disable-radix-cache Turn the prefix cache off", " ".join(parser.format_help().split()))

    def test_help_explains_the_grammar_backend(self):
        import argparse

        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        text = " ".join(parser.format_help().split())
        self.assertIn("--grammar-backend {xgrammar,none} Constrained decoding (structured outputs", text)
        self.assertIn("Default: xgrammar when it is installed, else none.", text)


def test_resolved_lora_backend_falls_back_only_where_triton_cannot_run(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ServerArgs(model_path="dummy", device="cpu").resolved_lora_backend() == "csgmv"
    monkeypatch.delenv("TRITON_INTERPRET")
    for backend in ("csgmv", "triton", "torch_native"):
        assert ServerArgs(model_path="dummy", device="cpu", lora_backend=backend).resolved_lora_backend() == "torch_native"
    with mock.patch("sglang.srt.utils.is_cuda", return_value=True):
        assert ServerArgs(model_path="dummy", lora_backend="triton").resolved_lora_backend() == "triton"
