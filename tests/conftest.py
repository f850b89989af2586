import collections
import contextlib
import os
from pathlib import Path

import jax
import pytest
from hypothesis import settings

# The native CPU layer is required in the tests: a failed build fails them instead of silently
# testing the portable path twice. Loop tests run on both backends (the `backend` fixture).
os.environ.setdefault("JAXDECODE_KERNELS", "1")
# The tests download nothing: a test that would fetch the corpus fails with the corpus error instead.
os.environ["JAXDECODE_OFFLINE"] = "1"
jax.config.update("jax_numpy_rank_promotion", "raise")

# The suite's time goes to XLA's compiler, not to running programs: measured over a full run at XLA's
# defaults, each worker spent about 1,040 of its 1,620 seconds in the CPU backend's compiles (and 300
# more tracing and lowering). The tests check what programs compute, not how fast, so they compile
# with LLVM's optimization turned down and XLA's older CPU code generator for fusions (the newer
# fusion emitters take twice as long to compile): 12 min 50 s in all against 27 min
# (docs/testing.md). The library itself compiles at XLA's defaults. $XLA_FLAGS, if set, wins.
# (LLVM's optimization is turned down through JAX's own switch, jax_disable_most_optimizations, so
# that a test marked `optimized` can turn it back up: see _optimized below. Turned back up, it runs
# at XLA's backend optimization level 1, not the default 3: the programs run as fast and compile in
# two thirds of the time; the speculative exactness draws went from 114 s to 85 s on two workers.)
OWN_XLA_FLAGS = "XLA_FLAGS" not in os.environ
if OWN_XLA_FLAGS:
    os.environ["XLA_FLAGS"] = "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=1"
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # for the processes the tests start
    jax.config.update("jax_disable_most_optimizations", True)

# One compilation cache on disk, shared by the xdist workers and kept between runs: a program that
# several tests, both workers or an earlier run built is loaded instead of compiled. Programs are
# keyed by their HLO, the compiler options and the jax version, so a hit is the same program. By
# default it lives in the checkout's own .pytest_cache (a clean clone, as .ci/run's, starts with an
# empty one); $JAXDECODE_TEST_JAX_CACHE names another folder. Measured (docs/testing.md): within
# one cold run it saves about what it costs (3% of CPU writing entries); a second run of the quick
# subset takes 37% less CPU with it warm. Past CACHE_KEEP_BYTES the least recently written entries
# go, at the start of a run.
CACHE_KEEP_BYTES = 1 << 30
_CACHE = os.environ.setdefault("JAXDECODE_TEST_JAX_CACHE", str(Path(__file__).resolve().parent.parent
                                                                   / ".pytest_cache" / "jaxdecode-jax-cache"))
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.05)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _prune_cache(folder: str, keep: int) -> None:
    """Removes the oldest entries of ``folder`` until the rest fit in ``keep`` bytes."""
    try:
        entries = [(e.stat().st_mtime, e.stat().st_size, e.path) for e in os.scandir(folder) if e.is_file()]
    except OSError:
        return
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= keep:
            break
        with contextlib.suppress(OSError):
            os.remove(path)
        total -= size


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controlling process, before the workers compile
        _prune_cache(_CACHE, CACHE_KEEP_BYTES)


# The quick subset for the inner loop, `python -m pytest -n auto -m quick` (docs/testing.md): a few
# tests of every file, chosen for what they cover at little cost (every layer: the rules, each loop
# on the character model against its plain reference, the Hugging Face fixtures' logits and greedy
# ids against transformers, the engines, the command line, the package layout). A test joins it by
# its name here (every parametrization) or its name with ids, ``name[ids]`` (that one), or with
# ``@pytest.mark.quick`` in its file. A test marked ``slow`` cannot be quick.
# tests/test_quick_subset.py checks that every name here is a test of its file and that every test
# file has a quick test.
QUICK = {  # a file: its quick tests, separated by white space
    "test_server_clients.py": "test_content_format_detected_from_the_template test_tool_call_formats_parse".split(),
    "test_beam.py": """test_beam_equals_plain_beam[native-5] test_beam_equals_plain_beam[portable-2]
        test_n_best_sorted_and_distinct test_stop_string_and_early_end
        test_end_token_and_length_penalty_change_the_winner test_bad_input[native]""".split(),
    "test_budget.py": """test_bad_request_settings test_budget_parsing test_rows_per_batch_and_groups
        test_score_split_equals_one_batch
        test_loops_refuse_what_does_not_fit_and_run_what_does[beam]""".split(),
    "test_chat_template.py": """test_the_fixture_covers_every_template_and_some_refusals
        test_renders_like_transformers test_bad_messages_are_refused_in_one_sentence
        test_a_folder_with_chat_template_jinja""".split(),
    "test_checkpoint.py": """test_converted_logits_match_torch test_save_load_round_trip_is_exact
        test_truncated_safetensors test_missing_tensor_is_named test_malicious_pt_top_level
        test_not_a_checkpoint_folder test_cli_convert_and_info""".split(),
    "test_cli.py": """test_generate_json test_score test_bad_input_is_one_line_exit_2 test_missing_checkpoint
        test_generate_beam_json test_generate_speculative_lookup_json
        test_every_rule_has_a_flag_and_every_flag_a_rule test_argparse_errors_are_one_line
        test_conflicting_or_bad_flags_are_refused_by_name test_stop_strings_and_finish_reason
        test_info_lists_each_field_once""".split(),
    "test_constrained_beam.py": """test_width_one_follows_greedy[native-1]
        test_compile_once_per_bucket[native]""".split(),
    "test_constraints.py": """test_automaton_agrees_with_re_on_every_short_string
        test_greedy_takes_the_most_probable_choice[native]
        test_masked_sampling_with_a_rule[native]
        test_rows_mix_patterns_and_free_rows_without_recompiling[native]
        test_cli_json_schema_and_bad_constraints""".split(),
    "test_contrastive.py": """test_matches_plain_loop_within_and_past_T[native-3-0.3]
        test_alpha_zero_and_k_one_are_greedy[native] test_stop_strings[native] test_bad_settings
        test_cli_contrastive_bad_input""".split(),
    "test_engine.py": """test_engine_matches_generate_any_order_and_slots
        test_neutral_settings_leave_logits_exactly_unchanged test_requests_are_checked
        test_simulator_is_deterministic_and_counts_prefill test_poisson_arrivals""".split(),
    "test_stop_with_constraint.py": ["test_no_hypothesis_is_an_error_not_an_empty_list",
                                     "test_include_stop_false_cuts_the_stop_in_every_loop"],
    "test_engine_schedules.py": ["test_a_free_row_in_a_slot_that_held_a_constrained_one"],
    "test_engine_constraints.py": """test_constrained_requests_are_checked_at_submit
        test_ignore_eos_with_an_end_token_constraint_is_refused""".split(),
    "test_exact.py": """test_markov_chain_without_rule_is_the_product_of_transitions
        test_markov_chain_with_top_k_renormalizes_each_step
        test_tiny_lm_without_rule_matches_full_forwards[native]
        test_chisquare_accepts_samples_from_the_distribution_and_rejects_others
        test_chisquare_pools_small_cells""".split(),
    "test_faults.py": """test_checkpoint_weights_interrupted test_atomic_folder_new_target_interrupted
        test_save_over_a_file_is_refused test_distilled_cache_write_interrupted
        test_study_output_interrupted""".split(),
    "test_gguf.py": "test_the_tokenizer_gives_the_folders_ids test_refusals_are_one_line".split(),
    "test_int4.py": "test_pack4_round_trip_and_nibble_order test_an_int4_rows_product_does_not_depend_on_the_other_rows".split(),
    "test_hf.py": """test_logits_equal_transformers test_greedy_ids_and_end_token_equal_transformers[llama]
        test_greedy_ids_and_end_token_equal_transformers[gpt2]
        test_continuation_logprobs_equal_transformers[qwen2]
        test_stop_strings_are_matched_on_the_text test_command_line_on_a_hugging_face_folder
        test_unsupported_model_type test_missing_tokenizer""".split(),
    "test_kernels.py": """test_native_layer_is_available test_kernel_matches_reference
        test_dense_matches_matmul test_decode_layer_matches_reference[2-2-4-16-17-5]
        test_paged_layer_matches_reference[5-1-4-16-4-6-phases]
        test_cached_decoding_with_kernel_matches_forward test_kernels_mode_is_checked""".split(),
    "test_layout.py": """test_each_module_imports_only_the_layers_below test_loops_never_name_a_concrete_model
        test_no_import_cycle test_folders_and_short_modules
        test_the_registries_are_one_type_and_take_a_users_entry""".split(),
    "test_logit_controls.py": """test_bias_and_allowed_tokens_match_numpy test_bad_words_match_vllms_loop
        test_min_tokens_matches_numpy test_a_bad_setting_is_one_error_naming_it""".split(),
    "test_mesh.py": "test_make_mesh_shapes_and_errors test_partition_rules_split_whole_heads_only".split(),
    "test_mesh_loading.py": """test_each_part_of_a_tensor_is_where_the_reader_split_puts_it
        test_a_bad_slice_is_refused_in_one_line""".split(),
    "test_mesh_multihost.py": ["test_the_demo_on_a_model_axis_in_one_process"],
    "test_model.py": """test_cache_matches_forward_ragged test_compile_once_per_bucket test_hidden_states
        test_config_validation""".split(),
    "test_own_model.py": """test_chain_greedy_is_the_argmax_walk test_chain_beam_and_mode_are_exhaustive
        test_chain_sampling_matches_the_matrix test_token_vocab test_documented_own_model_example""".split(),
    "test_paged.py": """test_allocate_append_free_and_errors test_fork_copy_on_write_and_reorder
        test_prefix_sharing test_paged_attention_matches_dense[portable]
        test_paged_attention_errors test_reorder_truncate_extend_match_dense
        test_write_cache_into_blocks""".split(),
    "test_paged_engine.py": """test_a_pool_for_one_row_serves_rows_one_at_a_time
        test_paged_settings_are_checked_and_dense_stays_the_default""".split(),
    "test_quick_subset.py": """test_every_quick_name_is_a_test_of_its_file
        test_every_quick_name_selects_a_test test_every_test_file_has_a_quick_test""".split(),
    "test_params.py": "test_a_bad_setting_is_one_error_naming_it test_keywords_override_fields".split(),
    "test_rules.py": """test_truncation_matches_reference test_temperature_matches_reference
        test_repetition_penalty_matches_reference
        test_frequency_and_presence_penalties_match_reference
        test_no_repeat_ngram_matches_reference test_chain_applies_parts_in_order_with_their_states
        test_invalid_settings_raise test_make_rule_applies_rules_in_registry_order
        test_make_rule_errors""".split(),
    "test_sampling.py": """test_greedy_equals_plain_loop[native-5] test_greedy_equals_plain_loop[portable-40]
        test_sampling_equals_plain_loop_with_same_keys test_stop_sequences[native]
        test_compile_once_per_bucket[portable] test_bad_input[native]""".split(),
    "test_score.py": """test_token_logprobs_past_T_match_the_book[portable]
        test_score_texts_with_and_without_a_prompt_past_T[portable] test_score_errors""".split(),
    "test_server.py": """test_completions_n_samples_equal_generate test_models_health_and_metrics""".split(),
    "test_server_mc.py": ["test_the_fixture_is_a_multiple_choice_set_the_model_can_encode"],
    "test_server_fuzz.py": ["test_the_body_parser_names_what_is_wrong",
                            "test_a_pattern_too_large_is_refused_before_it_is_compiled"],
    "test_sharding.py": """
        test_one_device_mesh test_pad_batch_and_mesh_checks test_gather_prompts_one_process""".split(),
    "test_smc.py": """test_exact_conditional_matches_brute_force[choices-n2] test_weights_are_p_over_q_exactly
        test_errors test_divergences""".split(),
    "test_speculative.py": """test_greedy_speculative_equals_greedy[native-model]
        test_greedy_speculative_equals_greedy[portable-lookup] test_generate_api[native]
        test_toy_acceptance_and_frequencies test_inverse_cdf_draws test_accept_all_and_greedy
        test_stop_strings_and_streaming[native] test_draft_registry test_the_loop_reads_no_files""".split(),
    "test_stop_strings.py": """test_issue_37_1_a_stop_string_ending_in_a_split_character_keeps_its_last_byte
        test_issue_37_4_extend_past_the_capacity_raises_naming_it
        test_aho_corasick_matches_a_plain_search""".split(),
    "test_studies.py": """test_write_json_is_deterministic_and_clean
        test_atomic_write_keeps_the_old_file_on_failure test_registry_errors
        test_every_study_module_has_run test_study_parser_lists_every_study
        test_decoders_study_files_and_determinism""".split(),
    "test_tradeoff.py": """test_words_drop_a_word_cut_at_the_end_or_continuing_the_prompt
        test_real_word_share_pools_words_over_samples test_repeated_trigrams_and_distinct_n
        test_probability_cdf_and_nll
        test_family_rule_has_one_setting_per_row_and_neutral_elsewhere
        test_every_family_is_one_call_of_one_compiled_program""".split(),
    "test_train.py": """test_missing_corpus_error test_corrupt_corpus_error""".split(),
    "test_warmup.py": """test_warm_up_keeps_a_pinned_layout_and_needs_an_idle_engine""".split(),
}


# The names in QUICK that matched no test of a file this run collected whole (a renamed test or
# parametrization); tests/test_quick_subset.py fails on any.
UNMATCHED_QUICK: list[str] = []


def _mark_quick(config, items):
    matched = set()
    for item in items:
        names = QUICK.get(item.path.name, ())
        for name in (getattr(item, "originalname", item.name), item.name):
            if name in names:
                matched.add((item.path.name, name))
                if item.get_closest_marker("slow") is not None:
                    raise pytest.UsageError(f"{item.nodeid} is marked slow and named in conftest.QUICK: a "
                                            f"quick test cannot be slow")
                item.add_marker(pytest.mark.quick)
    if not any("::" in str(a) for a in config.args):  # whole files collected
        files = {item.path.name for item in items}
        UNMATCHED_QUICK[:] = [f"{f}::{n}" for f in files for n in QUICK.get(f, ()) if (f, n) not in matched]


# What the largest work units cost: CPU seconds of a file's fast tests together (``file:<name>``,
# one xdist group), of an explicit xdist group, or of one slow test (``<file>::<name>``), measured
# with $JAXDECODE_TEST_PROFILE on a quiet machine (`python tools/test_profile.py <folder> --units`
# prints this table; the run of docs/testing.md's "after"). Only the order of the work depends on
# it: a unit not named here counts half a second a test, a slow test 5 s.
UNIT_SECONDS = {
    "file:test_engine_schedules.py": 130,
    "file:test_explorer.py": 100,
    "explorer-slow": 120,  # test_explorer.py's slow tests: the browser and the comparison (wall seconds, a loaded machine)
    "file:test_mesh.py": 90,
    "file:test_server_clients.py": 60,
    "file:test_stop_with_constraint.py": 55,
    "file:test_params.py": 40,
    "file:test_gguf.py": 30,
    "file:test_int4.py": 30,
    "file:test_mesh_multihost.py": 20,
    "file:test_mesh_loading.py": 10,
    "file:test_family_table.py": 10,
    "file:test_engine_constraints.py": 106,
    "file:test_hf.py": 59,
    "file:test_tokenization_study.py": 19,
    "file:test_hf_families.py": 24,
    "file:test_hf_weights.py": 14,
    "file:test_hf_fused.py": 12,
    "bpe_train": 14,
    "file:test_server.py": 74,
    "file:test_server_mc.py": 15,
    "file:test_server_fuzz.py": 50,
    "test_server_fuzz.py::test_fuzzed_requests_get_no_5xx_and_the_server_keeps_serving[every-endpoint]": 30,
    "file:test_sampling.py": 68,
    "file:test_constrained_beam.py": 62,
    "file:test_speculative.py": 60,
    "file:test_constraints.py": 47,
    "file:test_paged_engine.py": 43,
    "file:test_contrastive.py": 39,
    "file:test_kernels.py": 33,
    "file:test_smc.py": 32,
    "file:test_sharding.py": 27,
    "file:test_beam.py": 24,
    "file:test_engine.py": 24,
    "file:test_warmup.py": 24,
    "test_tradeoff.py::test_chapter_findings_on_the_shipped_model": 24,
    "test_constraints.py::test_ten_patterns_every_sample_matches": 23,
    "file:test_paged.py": 21,
    "file:test_stop_strings.py": 20,
    "file:test_studies.py": 20,
    "test_constrained_beam.py::test_shipped_model_every_hypothesis_matches": 19,
    "file:test_budget.py": 18,
    "file:test_cli.py": 18,
    "file:test_own_model.py": 17,
    "shipped_plain_beam": 13,
    "test_contrastive.py::test_shipped_model_matches_plain_loop_and_repeats_less_than_greedy": 13,
    "test_tradeoff.py::test_same_seed_same_bytes": 10,
    "test_speculative.py::test_exact_distribution_with_backoff_draft[native]": 9,
    "file:test_logit_controls.py": 40,
    "file:test_rules.py": 8,
    "test_speculative.py::test_exact_distribution_of_first_three_tokens[model-native-4]": 8,
    "file:test_model.py": 7,
    "file:test_score.py": 7,
    "test_speculative.py::test_exact_distribution_of_first_three_tokens[model-portable-2]": 7,
    "test_beam.py::test_beam_curse_study[native]": 6,
    "test_kernels.py::test_fused_decode_matches_module_path[128-4]": 6,
    "test_speculative.py::test_exact_distribution_of_first_three_tokens[distilled-native-1]": 6,
    "test_speculative.py::test_exact_distribution_of_first_three_tokens[lookup-native-4]": 6,
    "test_speculative.py::test_exact_distribution_of_first_three_tokens[lookup-portable-2]": 6,
    "test_speculative.py::test_exact_distribution_of_first_three_tokens[model-native-1]": 6,
    "test_own_model.py::test_multichar_loops_agree_cached_and_function": 5,
    "test_speculative.py::test_exact_distribution_of_first_three_tokens[distilled-native-4]": 5,
    "test_speculative.py::test_exact_distribution_of_first_three_tokens[distilled-portable-2]": 5,
    "test_speculative.py::test_exact_distribution_of_first_three_tokens[ngram-native-4]": 5,
    "test_speculative.py::test_exact_distribution_of_first_three_tokens[ngram-portable-2]": 5,
    "file:test_tradeoff.py": 4,
    "test_own_model.py::test_multichar_mode_search": 4,
    "test_sampling.py::test_shipped_greedy_300_equals_book_loop[portable]": 4,
    "test_speculative.py::test_exact_distribution_of_first_three_tokens[lookup-native-1]": 4,
    "test_speculative.py::test_exact_distribution_of_first_three_tokens[ngram-native-1]": 4,
    "test_speculative.py::test_noise_drawn_up_front_is_the_same_noise[many-native]": 4,
    "test_studies.py::test_decoders_study_shows_the_chapters_ordering": 4,
    "file:test_chat_template.py": 3,
    "file:test_exact.py": 3,
    "test_faults.py::test_training_save_interrupted_keeps_the_last_save": 3,
    "test_train.py::test_loss_falls": 3,
    "file:test_checkpoint.py": 2,
    "file:test_hf_folders.py": 2,
    "file:test_quick_subset.py": 2,
    "file:test_faults.py": 1,
    "file:test_layout.py": 1,
    "file:test_train.py": 1,
}


def _unit(item, fast: bool) -> str:
    """The work unit xdist hands out whole: the test's xdist group, else (a fast test) its file's."""
    group = item.get_closest_marker("xdist_group")
    if group is not None:
        return group.args[0] if group.args else group.kwargs.get("name", "default")
    return f"file:{item.path.name}" if fast else f"{item.path.name}::{item.name}"


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """Work units, longest first. xdist hands them out in this order (``--no-loadscope-reorder`` in
    pyproject.toml; by default it reorders them by their number of tests, which put every slow
    test, a unit of one, at the end of the run), so the run ends on short units, not on one worker
    finishing a minute-long test while the other waits.

    A file's fast tests are one unit (an xdist group per file) and run on one worker: they share
    their models and so their compiled programs, which one process then traces and compiles once
    instead of each worker doing it again. A slow test is a unit of its own, unless it shares an
    expensive reference with others through an xdist group of theirs.

    The marks go on before the other hooks run (``-m`` selects by them, xdist reads the groups);
    the order is set after them, pytest's own reordering by fixture included (the order within a
    unit stays pytest's: a session fixture's parameters are not set up again and again)."""
    _mark_quick(config, items)
    fast = {item: item.get_closest_marker("slow") is None for item in items}
    for item in items:
        item.stash[_UNIT] = _unit(item, fast[item])
        if fast[item] and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.stash[_UNIT]))
    result = yield
    per_unit = collections.Counter(item.stash[_UNIT] for item in items)
    cost = {u: UNIT_SECONDS.get(u, (0.5 if u.startswith("file:") else 5.0) * n) for u, n in per_unit.items()}
    items[:] = sorted(items, key=lambda item: (-cost[item.stash[_UNIT]], item.stash[_UNIT]))  # stable
    return result


_UNIT = pytest.StashKey[str]()


# $JAXDECODE_TEST_PROFILE=<folder>: each process writes one line of JSON a test to
# <folder>/<worker>.jsonl: wall and CPU seconds (this process's threads, and the processes it
# started), and JAX's compile events (jax.monitoring): tracing, lowering, XLA compiling, and the
# persistent cache's hits. `python tools/test_profile.py <folder>` sums them by file
# (docs/testing.md, "Where the suite's time goes").
_PROFILE = os.environ.get("JAXDECODE_TEST_PROFILE")
_EVENTS = collections.Counter()
if _PROFILE:
    import jax.monitoring

    def _on_duration(event, secs, **_):
        _EVENTS[event + ":s"] += secs
        _EVENTS[event + ":n"] += 1

    def _on_event(event, **_):
        _EVENTS[event + ":n"] += 1

    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _PROFILE:
        yield
        return
    import json
    import resource
    import time

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    before = dict(_EVENTS)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0, c0 = time.time(), time.process_time()
    yield
    t1, c1 = time.time(), time.process_time()
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    events = {k: round(v - before.get(k, 0), 4) for k, v in _EVENTS.items() if v != before.get(k, 0)}
    line = {"test": item.nodeid, "worker": worker, "start": t0, "wall": t1 - t0, "cpu": c1 - c0,
            "child_cpu": (kids1.ru_utime + kids1.ru_stime) - (kids.ru_utime + kids.ru_stime),
            "slow": item.get_closest_marker("slow") is not None,
            "quick": item.get_closest_marker("quick") is not None, "unit": item.stash.get(_UNIT, None),
            "events": events}
    os.makedirs(_PROFILE, exist_ok=True)
    with open(os.path.join(_PROFILE, f"{worker}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


# Every compiled CPU program keeps its machine code in a few memory mappings of its own, and JAX
# keeps every program it compiles. A test worker compiles tens of thousands of programs; at the
# kernel's limit on mappings (vm.max_map_count, 65,530 by default) mmap fails inside XLA's
# compiler, which then crashes the worker with a segmentation fault (tools/repro_map_count.py,
# docs/testing.md). So after any test that leaves the worker past half the limit, JAX's caches are
# dropped (the mappings go with the programs; the next tests compile what they need again).
MAP_LIMIT_FILE = "/proc/sys/vm/max_map_count"


def _mappings() -> int | None:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return None


def _map_limit() -> int | None:
    try:
        with open(MAP_LIMIT_FILE) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


MAP_LIMIT = _map_limit()


@pytest.fixture(autouse=True)
def _bounded_mappings():
    yield
    if MAP_LIMIT is not None and (_mappings() or 0) > MAP_LIMIT // 2:
        import gc

        jax.clear_caches()
        gc.collect()

# Hypothesis draws the same examples on every run (a seed derived from each test), so a failure
# reproduces and a pass means the same thing on every machine; HYPOTHESIS_PROFILE=explore draws
# new examples on each run instead.
settings.register_profile("derandomized", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "derandomized"))

BACKENDS = ("native", "portable")


@pytest.fixture(params=BACKENDS, scope="session")
def backend(request):
    """Each backend in turn: the native CPU layer, then the portable jax.numpy path."""
    return request.param

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def key():
    return jax.random.PRNGKey(0)


def locate_test_corpus() -> str:
    """The corpus named by $JAXDECODE_DATA. Unset: the test is skipped. Set to a path that is not
    a file: the test fails (a misconfigured run must not pass by skipping the corpus tests)."""
    p = os.environ.get("JAXDECODE_DATA")
    if not p:
        pytest.skip("the corpus is not available: set $JAXDECODE_DATA to Tiny Shakespeare's input.txt")
    if not Path(p).is_file():
        pytest.fail(f"$JAXDECODE_DATA names {p}, which is not a file: point it at Tiny Shakespeare's "
                    f"input.txt, or unset it to skip the tests that need the corpus", pytrace=False)
    return p


@pytest.fixture(scope="session")
def corpus_path():
    """See :func:`locate_test_corpus`."""
    return locate_test_corpus()


@pytest.fixture(scope="session")
def tiny_model():
    """A small random-weight model (V=12, T=16) with a readable vocabulary: (cfg, params, vocab)."""
    from jaxdecode.models.charlm.transformer import ModelConfig, init_params
    from jaxdecode.io.vocab import Vocab

    cfg = ModelConfig(V=12, T=16, d=32, L=2, heads=4)
    params = init_params(cfg, jax.random.PRNGKey(42))
    # sharper than the 0.02 init so that distributions are far from uniform
    params = jax.tree_util.tree_map(lambda a: a * 3.0, params)
    return cfg, params, Vocab(" abcdefghi.\n")


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_model, tmp_path_factory):
    """``tiny_model`` saved as a checkpoint folder (for the command line)."""
    from jaxdecode.models import checkpoint

    cfg, params, vocab = tiny_model
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    checkpoint.save(path, params, cfg, vocab, meta={"note": "random weights"})
    return str(path)


@pytest.fixture(scope="session")
def tiny_lm(tiny_model, backend):
    """``tiny_model`` as a LanguageModel on each backend."""
    from jaxdecode.models.checkpoint import LanguageModel

    cfg, params, vocab = tiny_model
    return LanguageModel(params=params, cfg=cfg, vocab=vocab, meta={}, backend=backend)


@pytest.fixture(autouse=True)
def _optimized(request):
    """A test marked ``optimized`` compiles at XLA's backend optimization level 1, not the suite's lowest:
    for tests whose programs run for seconds (tens of thousands of rows, hundreds of forwards of
    the shipped model), where optimized code saves more than its longer compile costs."""
    if not request.node.get_closest_marker("optimized"):
        yield
        return
    from compiled import optimized

    with optimized():
        yield
