"""Test tiers ([Note: test tiers] below) and the `gpus(n)` marker: `@pytest.mark.gpus(2)` skips a test unless at least n CUDA GPUs are visible
(the reason names how many it needs and how many there are), and marks it `gpu` as well, so
`pytest -m gpu` (run on the device) selects exactly the GPU tests and the default CPU run skips them."""
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): needs n CUDA GPUs and NCCL; also marks the test `gpu`; skipped "
                            "when fewer GPUs are visible")


def _needed(marker):
    n = marker.args[0] if marker.args else marker.kwargs.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise pytest.UsageError(f"@pytest.mark.gpus(n) needs a positive int n, got {marker.args} {marker.kwargs}")
    return n


# tryfirst: the `gpu` marker must be on the items before `-m gpu` deselects by marker. One hook per plugin
# module: it marks, then keeps the default tier.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    _mark_gpus(items)
    _default_tier(config, items)


def _mark_gpus(items):
    available = None
    for item in items:
        marker = item.get_closest_marker("gpus")
        if marker is None:
            continue
        n = _needed(marker)
        if item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.gpu)
        if available is None:
            import torch
            from tests.harness import ranks_on_one_gpu
            available = torch.cuda.device_count()
            if available and ranks_on_one_gpu():  # [Note: ranks on one GPU] in tests/harness.py
                available = max(available, ranks_on_one_gpu())
        if available < n:
            item.add_marker(pytest.mark.skip(reason=f"needs {n} CUDA GPU{'s' if n > 1 else ''}, {available} visible "
                                             f"(run on the device: pytest -m gpu)"))


# [Note: test tiers] `pytest tests` runs the default tier: a few tests of every area (build, config, engine,
# claims, gradients, many ranks and non-uniform programs, faults, HF, TRL, weights, the differential test's
# regressions), about 5 minutes on 2 idle cores; `pytest tests --full` runs everything (CI runs the default
# tier, then `--beyond-default`: the rest). A
# test is in the default tier when its node id (without `tests/`) starts with an entry of DEFAULT_TIER;
# new tests are in the full suite until listed here. Naming files, tests, `-k` or `-m` selects as usual.
DEFAULT_TIER = (
    "test_asymmetric_grads.py::test_heads_used_by_some_ranks_train_to_ddps_numbers[one-module-a-or-b-1-2]",
    "test_build.py::test_import_loads_no_dynamo_and_creates_no_cuda_context",
    "test_build.py::test_missing_ninja_says_what_to_install",
    "test_build.py::test_the_report_builds_nothing_and_says_where_a_build_would_go",
    "test_build.py::test_a_broken_compiler_gets_the_report_and_names_the_problem[build-cxx-false]",
    "test_launcher.py::test_no_launcher_gets_the_torchrun_hint[pth]",
    "test_handover.py::test_one_line_says_what_z3ext_owns_and_hands_to_deepspeed[offload_optimizer_cpu]",
    "test_package.py::",
    "test_seams.py::test_only_the_seam_layer_assigns_to_deepspeed",
    "test_config.py::test_bad_section_value_names_the_key",
    "test_config.py::test_a_lookalike_section_key_names_the_right_one",
    "test_config.py::test_an_unknown_key_gets_the_list_of_valid_keys[far_off_key]",
    "test_config.py::test_deepspeed_option_refused_by_name_unless_default",
    "test_core.py::test_config_validation_and_dispatch",
    "test_core.py::test_fetch_groups_one_unit_per_block",
    "test_core.py::test_member_hooks_are_lifted_while_their_group_is_open",
    "test_equivalence.py::test_bitwise_equal_to_stock[nomel-zeroinit-persist0]",
    "test_true_release.py::test_a_read_of_a_released_parameter_raises_naming_it",
    "test_ownership.py::test_gathered_parameters_between_and_around_forward",
    "test_gradients.py::test_gradient_path_bitwise_equal_to_stock[ga3]",
    "test_master.py::test_partition_is_the_master_bitwise_equal_to_stock[bf16-2]",
    "test_rank_symmetry.py::test_grad_forward_kept_by_rank0_only",
    "test_schedule_check.py::test_different_gathers_raise_on_every_rank",
    "test_conditional.py::test_experts_without_tokens_step_on_zero_gradients[block]",
    "test_conditional.py::test_per_expert_moe_routed_by_rank_equals_stock_with_a_leaf[2-fp32]",
    "test_conditional.py::test_a_module_some_ranks_skip_trains_as_with_a_dummy_input[2-fp32]",
    "test_conditional.py::test_detection_finds_expert_blocks_only",
    "test_agreement.py::test_leak_check_on_one_rank_raises_on_every_rank[2]",
    "test_faults.py::test_a_fault_on_one_rank_ends_in_an_error_on_every_rank",
    "test_watchdog.py::test_a_rank_stuck_in_user_code_is_named_on_every_rank[2-no-agree]",
    "test_watchdog.py::test_the_verdict_names_the_first_difference",
    "test_deadline.py::test_the_deadline_is_the_group_timeout_less_a_margin[30-25]",
    "test_generation.py::test_memory_efficient_linear_is_stocks_bits_without_its_python_function",
    "test_hf.py::test_hf_trainer_full_finetune",
    "test_trl.py::test_sft",
    "test_weights.py::test_full_weights_on_one_rank",
    "test_differential.py::test_regressions_bitwise_equal_to_stock",
    "test_examples.py::",
)


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="run the full suite, not only the default tier "
                     "([Note: test tiers] in tests/conftest.py)")
    parser.addoption("--beyond-default", action="store_true", help="run the tests the default tier leaves out "
                     "(CI: the default tier, then these: the full suite once)")


def _default_tier(config, items):
    if config.getoption("--full") or config.getoption("-m") or config.getoption("-k") or any(
            ".py" in a for a in config.args):
        return  # the full suite, or a selection the command line makes itself (-k, -m, a file, a test)
    kept, left = [], []
    for item in items:
        nodeid = item.nodeid.split("tests/", 1)[-1]
        (kept if nodeid.startswith(DEFAULT_TIER) else left).append(item)
    if config.getoption("--beyond-default"):
        kept, left = left, kept
    if left and len(items) > 1:
        config.hook.pytest_deselected(items=left)
        items[:] = kept
