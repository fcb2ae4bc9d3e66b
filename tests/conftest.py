import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread per worker, for it and every process it starts: two processes of two threads each on two cores
    # spin against each other (the suite took 1120 s instead of 663 s so), one thread each keeps both cores busy.
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"

import torch  # noqa: E402  (after the thread count, which torch reads once)

ROOT = Path(__file__).resolve().parents[1]
# the benchmarks themselves, which some tests check (the GPU check's plumbing, the floors, the committed records),
# importable as top-level modules (after every other path: they shadow nothing)
sys.path.append(str(ROOT / "benchmarks"))
SHARED_DATA = ROOT.parent / "shared" / "data"
SHARED_HUB = ROOT.parent / "shared" / "litgpt_config_hub"
# What each method's checkpoint holds its trained weights in: litgpt's names, which its tools read, written here
# apart from memfit.training.checkpoint.WEIGHTS_FILES so that a wrong name there fails the tests
WEIGHTS = {
    "lora": "lit_model.pth.lora",
    "adapter": "lit_model.pth.adapter",
    "adapter_v2": "lit_model.pth.adapter_v2",
    "full": "lit_model.pth",
    "pretrain": "lit_model.pth",
}
# Every recipe; tests run on each of them catch drift between the scripts
SCRIPTS = [
    "finetune/lora.py",
    "finetune/adapter.py",
    "finetune/adapter_v2.py",
    "finetune/full.py",
    "pretrain/pretrain.py",
]


# The fast tier, run before each commit: pytest -m "not slow". A test that runs a recipe (a training run or an
# estimate, in a process or in this one) or starts a process is marked slow where it is written: @pytest.mark.slow,
# or a module's pytestmark where every test of the module is. The rest test functions and files directly.


# The extended tier (pytest -m extended; CI and a plain `pytest` leave it out, to keep the suite under 20 minutes on
# 2 cores): more cases of a behaviour another test in the default tier already proves, each named with the test that
# keeps it. Run it before a release and after changing the module it names. tests/test_bad_input.py marks its own: the
# flag, checkpoint and data cases it runs on lora.py alone by default (ON_EVERY_SCRIPT and ON_EVERY_FINETUNING_SCRIPT
# there say which every script runs).
EXTENDED = {
    # a compiled run resumed: the eager resume of every method (test_checkpoint.py) and a compiled run against an
    # eager one (test_compile.py) stay; this adds three compiled runs
    "tests/test_compile.py::test_a_compiled_run_resumed_ends_as_an_uninterrupted_compiled_one",
    # compiled under FSDP: a compiled run against an eager one on one process (test_compile.py) and FSDP against one
    # process (test_fsdp.py) stay; this adds two 2-process runs, one compiling (about half a minute of CPU)
    "tests/test_compile.py::test_fsdp_compiled_trains_as_eager_fsdp_and_its_estimate_follows",
    # QLoRA compiled: LoRA compiled in the benchmark (benchmarks/compile.py) and a compiled run against an eager one
    # (above) stay; this adds a compiling QLoRA run (bitsandbytes' layers break each block's graph)
    "tests/test_compile.py::test_qlora_compiled_trains_as_eager_qlora_and_its_estimate_follows",
    # a larger micro-batch never takes less memory: LoRA's case stays (the same estimate across the head's chunk size;
    # full fine-tuning differs in what trains, which the estimate tests measure)
    "tests/test_most_that_fits.py::test_a_larger_micro_batch_never_takes_less_memory[finetune/full.py]",
    # the most a budget holds: the sequence case stays (the micro-batch's boundary is the same search); the README's
    # block is its command's output (a minute of CPU for an 8B model)
    "tests/test_most_that_fits.py::test_the_answer_fits_when_run_and_the_next_value_does_not[--train.micro_batch_size-6-7-train1]",
    "tests/test_most_that_fits.py::test_the_readmes_what_fits_block_is_the_commands_output",
    # FSDP equals one process: lora-fsdp0 and full-fsdp2 stay (LoRA and full, offload and accumulation covered there)
    "tests/test_fsdp.py::test_fsdp_on_two_processes_trains_what_one_process_trains[full-fsdp1]",
    "tests/test_fsdp.py::test_fsdp_on_two_processes_trains_what_one_process_trains[lora-fsdp3]",
    # every script under FSDP: pretraining stays (its own init and data path); adapters share fine-tuning's
    "tests/test_fsdp.py::test_every_other_script_trains_under_fsdp_what_one_process_trains[adapter]",
    "tests/test_fsdp.py::test_every_other_script_trains_under_fsdp_what_one_process_trains[adapter_v2]",
    # the comparison can fail: the torchrun case stays
    "tests/test_fsdp.py::test_the_comparison_fails_on_a_planted_defect[rank1_loss_twice-fabric]",
    # several nodes: two torchrun nodes under FSDP stay; SLURM's variables are read as Fabric reads them in
    # test_several_nodes_under_a_launcher_are_not_refused[srun], and offload is covered by lora-fsdp0 and full-fsdp2
    "tests/test_fsdp.py::test_two_slurm_tasks_train_what_one_process_trains",
    # two torchrun nodes: FSDP stays, DDP is the simpler path
    "tests/test_fsdp.py::test_two_torchrun_nodes_train_what_one_process_trains[ddp]",
    # a rank loads its share: 2 ranks with a dtype change (a bfloat16 checkpoint under 32-true, the copy a rank must
    # not make of the whole model) stays; without one, and 4 ranks, are the same loading
    "tests/test_fsdp.py::test_each_rank_loads_its_share_not_the_model[2-dtypes1]",
    "tests/test_fsdp.py::test_each_rank_loads_its_share_not_the_model[4-dtypes2]",
    # a sharded checkpoint resumes exactly: after SIGTERM stays (rank 0 signalled alone, the steps saved, resumed from
    # the sharded step-* it wrote); the SIGKILL case resumes the same kind of step-* (test_checkpoint.py resumes
    # exactly and falls back from a damaged latest checkpoint on one process)
    "tests/test_fsdp.py::test_fsdp_resumes_a_sharded_checkpoint_exactly_after_sigkill_and_after_sigterm[SIGKILL]",
    # a sharded checkpoint reshards on resume: 2 processes to 1 stays
    "tests/test_fsdp.py::test_fsdp_checkpoint_of_two_processes_resumes_on_one_and_on_four[4]",
    # preemption saves and resumes exactly: lora and pretrain stay (fine-tuning's loop and pretraining's)
    "tests/test_signals.py::test_a_preempted_run_saves_its_steps_and_resume_auto_ends_as_a_run_left_alone[adapter-10]",
    "tests/test_signals.py::test_a_preempted_run_saves_its_steps_and_resume_auto_ends_as_a_run_left_alone[adapter_v2-1]",
    "tests/test_signals.py::test_a_preempted_run_saves_its_steps_and_resume_auto_ends_as_a_run_left_alone[full-10]",
    # no arguments: lora (the signature tests), full and pretrain stay
    "tests/test_methods.py::test_script_runs_with_no_arguments[finetune/adapter.py]",
    "tests/test_methods.py::test_script_runs_with_no_arguments[finetune/adapter_v2.py]",
    # a hub file trains: phi-2/full and gemma2-2b/lora stay
    "tests/test_config_hub.py::test_a_hub_file_trains_with_only_the_model_and_data_swapped[finetune/phi-2/qlora.yaml]",
    # the estimate within 10%: one case of each script and technique stays; bitsandbytes' nf4 under LoRA is
    # test_a_4bit_heads_dequantized_copy_is_counted_where_the_head_multiplies_by_it (within 3%), bf16-mixed is full
    # fine-tuning's case
    "tests/test_estimate.py::test_prediction_within_ten_percent_of_the_measured_peak[finetune/lora.py-options0]",
    "tests/test_estimate.py::test_prediction_within_ten_percent_of_the_measured_peak[finetune/lora.py-options10]",
    "tests/test_estimate.py::test_prediction_within_ten_percent_of_the_measured_peak[finetune/full.py-options6]",
    "tests/test_estimate.py::test_prediction_within_ten_percent_of_the_measured_peak[finetune/full.py-options7]",
    "tests/test_estimate.py::test_prediction_within_ten_percent_of_the_measured_peak[finetune/full.py-options8]",
    # other architectures: Gemma-2 and phi-2 stay; Phi-3 is a Llama-shaped block with a fused MLP projection
    "tests/test_estimate.py::test_prediction_matches_the_measured_peak_across_litgpt_architectures[Phi-3-mini-4k-instruct-shape5]",
    "tests/test_estimate.py::test_prediction_matches_the_measured_peak_across_litgpt_architectures[Gemma-3-1b-it-shape1]",
    "tests/test_estimate.py::test_prediction_matches_the_measured_peak_across_litgpt_architectures[falcon-7b-shape3]",
    "tests/test_estimate.py::test_prediction_matches_the_measured_peak_across_litgpt_architectures[Qwen2.5-0.5B-shape4]",
    # validation changes nothing: the quantized paths (lora, adapter_v2) and pretraining stay
    "tests/test_validation_neutral.py::test_validation_and_samples_every_two_steps_give_the_same_weights"
    "[finetune/adapter.py-bnb.nf4-lit_model.pth.adapter]",
    "tests/test_validation_neutral.py::test_validation_and_samples_every_two_steps_give_the_same_weights"
    "[finetune/full.py-None-lit_model.pth]",
    # resume for every method: full stays, and LoRA's resume is test_resume_continues_exactly (10 steps, the latest
    # checkpoint half-written, a GPU's random generator); pretraining resumes after a real SIGTERM in test_signals.py
    "tests/test_checkpoint.py::test_resume_for_every_method[finetune/lora.py]",
    "tests/test_checkpoint.py::test_resume_for_every_method[finetune/adapter.py]",
    "tests/test_checkpoint.py::test_resume_for_every_method[finetune/adapter_v2.py]",
    "tests/test_checkpoint.py::test_resume_for_every_method[pretrain/pretrain.py]",
    # the data order on resume: test_resume_continues_exactly stays (the same batches, bit for bit)
    "tests/test_checkpoint.py::test_resume_keeps_the_data_order_when_the_profiler_window_changes",
    # FSDP's estimate: test_fsdp_estimate_within_three_percent_of_the_measured_rank_peak (2 and 4 ranks) and the
    # offload estimate stay; the large head's single copy, the host memory per rank and the accumulation variants are
    # more cases of the same per-rank model
    "tests/test_fsdp.py::test_a_large_vocabulary_is_estimated_and_holds_one_copy_of_its_head",
    "tests/test_fsdp.py::test_each_ranks_host_memory_is_reported_and_estimated",
    "tests/test_estimate.py::test_fsdp_estimate_shards_gradients_under_accumulation_unless_asked_and_gathers_one_of_embedding_and_head",
    # torchao's NF4 under FSDP: quantized a unit at a time on each rank stays (the QLoRA run is the same path trained)
    "tests/test_fsdp.py::test_qlora_on_two_fsdp_processes_with_a_torchao_nf4_base",
    # FSDP equals one process: bf16-true on this CPU's kernels stays; bf16-mixed and the other kernel family are
    # the same comparison under another precision plugin and another CPU's kernels
    "tests/test_fsdp.py::test_bf16_mixed_gathers_bfloat16_copies_of_float32_shards",
    "tests/test_fsdp.py::test_fsdp_on_other_kernels_trains_what_one_process_trains",
    # several nodes: two torchrun nodes (FSDP) and two SLURM tasks stay; hybrid sharding is the 4-process variant
    "tests/test_fsdp.py::test_hybrid_sharding_on_two_torchrun_nodes_of_two_processes",
    # a rank's share: loading it stays (each_rank_loads_its_share_not_the_model[2-dtypes0]); initialising it from
    # scratch is pretraining's path of the same sharded build
    "tests/test_fsdp.py::test_pretraining_from_scratch_initialises_a_ranks_share_not_the_model",
    # the planner: test_planner_lists_settings_that_fit_fastest_first and the fewest-blocks test in
    # test_most_that_fits.py stay; the rows' training labels are a further case
    "tests/test_planner.py::test_the_planners_rows_say_whether_they_change_the_training_and_none_saves_nothing",
    # a real CPU out-of-memory's first suggestion runs under the same limit: the planner's answers are run at their
    # boundary in the default tier (test_most_that_fits.py's test_the_answer_fits_when_run_and_the_next_value_does_not),
    # and the real failure's explanation stays (test_the_advice_after_an_out_of_memory_under_ulimit_holds_when_followed)
    "tests/test_planner.py::test_the_first_setting_a_real_cpu_out_of_memory_suggests_runs_under_the_same_limit",
    # the planner's whole-depth traces made only when a plan's turn comes, and above 64 only what may fit: what they
    # save is benchmarks/estimate_speed.py's; the rows stay tested (test_planner_lists_settings_that_fit_fastest_first,
    # and test_most_that_fits.py's fewest-blocks test, which also tries larger micro-batches)
    "tests/test_planner.py::test_the_planner_traces_a_whole_depth_plan_only_when_its_turn_comes",
    "tests/test_most_that_fits.py::test_the_planner_offers_a_micro_batch_above_64_and_traces_only_what_may_fit",
    # an out-of-memory's explanation: LoRA's real CPU allocation failure stays (exit 3, what was held, the settings
    # that fit, nothing saved, and its first suggestion run under the same limit); this is the same in a simulated one
    "tests/test_planner.py::test_out_of_memory_ends_with_an_explanation",
    # a real CPU out-of-memory in full fine-tuning: LoRA's, whose advice is then followed, checks the same explanation
    # (test_the_advice_after_an_out_of_memory_under_ulimit_holds_when_followed)
    "tests/test_planner.py::test_a_real_cpu_allocation_failure_ends_with_an_explanation",
    # pretraining on litgpt's TextFiles: the Ctrl-C resume stays in test_signals.py, TextFiles without litdata is one
    # line (test_textfiles_without_litdata_says_how_to_install_it)
    "tests/test_litgpt_carry_over.py::test_pretrain_trains_on_litgpt_textfiles_and_resumes_after_ctrl_c",
    # loggers: each missing package is one line, wandb's stays
    "tests/test_litgpt_carry_over.py::test_logger_mistakes_are_one_line"
    "[args1-env1---logger_name mlflow needs the mlflow package, which is not installed: pip install mlflow]",
    # a long accumulation traced from its last micro-batch: test_profiling's 4-micro-batch cases stay
    "tests/test_profiling.py::test_a_64_micro_batch_step_is_profiled_in_the_memory_of_a_4_micro_batch_one",
    "tests/test_profiling.py::test_torchs_profiler_lines_do_not_run_into_the_progress_bar",
    # equal to litgpt's own CLI: LoRA stays (full fine-tuning's loss weighting is documented in docs/litgpt.md)
    "tests/test_litgpt_parity.py::test_full_fine_tuning_equals_litgpts_own_cli_and_the_loss_weighting_is_the_one_difference",
    # Ctrl-C: the preempted-run cases with SIGINT and the burst of Ctrl-C stay
    "tests/test_signals.py::test_ctrl_c_in_an_overwriting_run_keeps_the_run_it_replaces",
    "tests/test_signals.py::test_a_signal_during_the_embedded_defaults_first_build_leaves_no_staging_dir"
    "[2-130-Interrupted (Ctrl-C) before training began: nothing was saved]",
    "tests/test_signals.py::test_a_signal_while_the_profiler_writes_its_trace_leaves_nothing_partial[2-130]",
    # a hub file trains: gemma2-2b/lora stays
    "tests/test_config_hub.py::test_a_hub_file_trains_with_only_the_model_and_data_swapped[finetune/phi-2/full.yaml]",
    # no arguments: lora (the signature tests) and pretrain stay
    "tests/test_methods.py::test_script_runs_with_no_arguments[finetune/full.py]",
    # the shallow extrapolation equals a whole-depth trace: 3 checkpointed blocks stay
    "tests/test_most_that_fits.py::test_a_step_extrapolated_from_shallow_models_is_the_whole_depth_trace_to_the_byte[1]",
    # an estimate by model name builds no embedded default: the seconds it takes are benchmarks/estimate_speed.py's
    "tests/test_estimate.py::test_estimate_from_a_model_name_in_seconds",
    # the cards an estimate fits: the README's 7B estimate stays (test_the_readmes_7b_estimate_command_predicts_its_
    # tables_row) and a budget naming a card (test_a_budget_may_name_the_card); this adds the GB note and the list
    "tests/test_estimate.py::test_an_estimate_says_which_cards_it_fits_and_a_budget_in_gb_how_it_was_read",
    # no arguments: pretraining's embedded default trains in test_signals.py (preempted and resumed) and in FSDP's
    # every_other_script case
    "tests/test_methods.py::test_script_runs_with_no_arguments[pretrain/pretrain.py]",
    # every optimizer trains: AdamW, SGD and AdamW8bit stay; on a CPU a paged optimizer is its unpaged self
    # (test_a_paged_optimizer_on_cpu_keeps_its_state_like_the_unpaged_one)
    "tests/test_methods.py::test_every_optimizer_trains_on_cpu[PagedAdamW]",
    "tests/test_methods.py::test_every_optimizer_trains_on_cpu[PagedAdamW8bit]",
    # every quantize mode trains: nf4-dq and int8-training stay; fp4 is bitsandbytes' same 4-bit path with another
    # code table, and nf4 trains in the README's main job (test_signature_command.py, bf16-true) and under adapter_v2
    # (test_adapters_train_on_a_quantized_base, 32-true)
    "tests/test_quantize.py::test_every_quantize_mode_trains_on_cpu[bnb.nf4]",
    "tests/test_quantize.py::test_every_quantize_mode_trains_on_cpu[bnb.fp4]",
    "tests/test_quantize.py::test_every_quantize_mode_trains_on_cpu[bnb.fp4-dq]",
    # a quantized base under an adapter: adapter_v2 stays (adapter's layers are a subset of its)
    "tests/test_methods.py::test_adapters_train_on_a_quantized_base[finetune/adapter.py]",
    # torchao's NF4 under FSDP (test_quantize.py trains torchao.nf4 on one process)
    "tests/test_fsdp.py::test_a_torchao_nf4_base_is_quantized_a_unit_at_a_time_on_each_rank",
    # a rank's failure ends the others in one line: the SIGKILLed rank's sharded resume stays in
    # test_fsdp_resumes_a_sharded_checkpoint_exactly... (SIGTERM case), the one-process faults in test_signals.py
    "tests/test_fsdp.py::test_a_rank_whose_peer_is_killed_ends_in_one_line",
    # the profiler window's host memory against its estimate (docs/memory.md's figures): the estimate's own table is
    # in test_a_recipes_memory_line_is_what_the_estimate_predicts_today
    "tests/test_profiling.py::test_the_estimate_predicts_the_windows_host_memory",
    # preemption: SIGTERM of pretraining and Ctrl-C of LoRA stay
    "tests/test_signals.py::test_a_preempted_run_saves_its_steps_and_resume_auto_ends_as_a_run_left_alone[lora-15]",
    # two runs at once: the lock (test_a_held_lock_refuses...) and the embedded default built once stay
    "tests/test_out_dir.py::test_two_runs_started_together_get_their_own_profile_dirs",
    # loggers: MLflow's files every step stays; wandb offline is the same Fabric logger path
    "tests/test_litgpt_carry_over.py::test_wandb_logger_files_the_run_offline",
    # the GPU benchmarks' floors: their configurations parse and have floors (test_floor.py) stays
    "tests/test_floor.py::test_the_floor_stays_under_the_estimate_for_qlora_7b",
    # QLoRA through validation on either CPU family: the AVX512-BF16 family's case stays (this CPU's own family
    # validates QLoRA in test_validation_and_samples_every_two_steps_give_the_same_weights)
    "tests/test_validation_neutral.py::test_qlora_trains_through_validation_on_either_cpu_family[False]",
    # memory-efficient loading: a rank loads its share, not the model (test_fsdp.py, measured per rank) stays; the
    # anonymous memory of one process's mmap+assign load is also benchmarks/loading.py's committed result
    "tests/test_loading.py::test_loading_adds_little_anonymous_memory",
    # where a checkpoint is staged: a save on a full disk and resumes stay (test_out_dir.py, test_checkpoint.py)
    "tests/test_checkpoint.py::test_checkpoints_are_written_beside_their_destination_not_in_tmpdir",
    # a preemption saves and resumes: lora (SIGTERM, SIGINT), full (SIGUSR1) and pretraining stay; the adapters share
    # fine-tuning's loop and memfit.training.signals
    "tests/test_signals.py::test_a_preempted_run_saves_its_steps_and_resume_auto_ends_as_a_run_left_alone[adapter-10]",
    "tests/test_signals.py::test_a_preempted_run_saves_its_steps_and_resume_auto_ends_as_a_run_left_alone[adapter_v2-1]",
    # a hub file trains as in litgpt: phi-2's QLoRA and full fine-tuning stay; Gemma 2's soft-capped head is kept by
    # tests/test_loss.py, its architecture's code paths by
    # test_the_swapped_model_keeps_each_hub_architectures_code_paths
    "tests/test_config_hub.py::test_a_hub_file_trains_with_only_the_model_and_data_swapped[finetune/gemma2-2b/lora.yaml]",
    # the step as a formula equals concrete traces to the byte: LoRA's formula evaluated at a setting of its piece
    # against that setting's concrete trace stays (test_a_size_of_one_is_traced_concretely_and_the_formula_outside_its
    # _region_is_never_used); the grid over the loss's chunks, the adapter's trainable prompt, checkpointed bf16 LoRA,
    # full fine-tuning's accumulation and checkpointing, pretraining's two and adapter_v2 trace the same formula over
    # other operators (a checkpointed block's recomputation among them), each 1 to 5.5 minutes of a CI core
    "tests/test_symbolic_step.py::test_the_formula_is_the_concrete_trace_to_the_byte[lora-settings0]",
    "tests/test_symbolic_step.py::test_the_formula_is_the_concrete_trace_to_the_byte[adapter-settings6]",
    "tests/test_symbolic_step.py::test_the_formula_is_the_concrete_trace_to_the_byte[lora-settings1]",
    "tests/test_symbolic_step.py::test_the_formula_is_the_concrete_trace_to_the_byte[full-settings2]",
    "tests/test_symbolic_step.py::test_the_formula_is_the_concrete_trace_to_the_byte[full-settings3]",
    "tests/test_symbolic_step.py::test_the_formula_is_the_concrete_trace_to_the_byte[pretrain-settings4]",
    "tests/test_symbolic_step.py::test_the_formula_is_the_concrete_trace_to_the_byte[pretrain-settings5]",
    "tests/test_symbolic_step.py::test_the_formula_is_the_concrete_trace_to_the_byte[adapter_v2-settings7]",
    # FSDP's last save gathers the whole state dict whatever the checkpoints' format: the sharded format's run stays
    # (its step checkpoints sharded, its final/ consolidated, both phases measured against the estimate)
    "tests/test_run_phases.py::test_a_full_state_dict_save_under_fsdp_is_the_runs_peak_and_the_estimate_says_so[full]",
    # the FSDP estimate within 3% of a rank's measured peak: 2 ranks stay (4 ranks divide the same shards further)
    "tests/test_fsdp.py::test_fsdp_estimate_within_three_percent_of_the_measured_rank_peak[4]",
    # a tied head under FSDP: the untied trained head's FSDP run against its estimate stays
    # (test_a_trained_head_under_fsdp_takes_the_loss_path_one_device_takes), and so does a tied head's two gradients
    # summed in place on one device (test_a_tied_heads_two_gradients_are_summed_in_place_as_the_run_sums_them)
    "tests/test_fsdp.py::test_a_tied_head_under_fsdp_is_estimated_as_its_unit_reduces",
    # a preempted run saves and --resume auto ends as one left alone: LoRA's Ctrl-C stays; SIGTERM's preemption stays
    # in FSDP's exact resume, the profiler's trace being written and the recorded step's views (test_signals.py)
    "tests/test_signals.py::test_a_preempted_run_saves_its_steps_and_resume_auto_ends_as_a_run_left_alone[pretrain-15]",
    # the exactness comparison can fail: rank 1's loss weighted twice under Fabric's launcher stays; this adds two
    # torchrun nodes whose gradients are never reduced
    "tests/test_fsdp.py::test_the_comparison_fails_on_a_planted_defect[no_gradient_sync-torchrun]",
    # the logits never whole: the trained head's case stays (the same chunked loss, with the head's gradient too)
    "tests/test_loss.py::test_the_logits_never_exist_whole[lora]",
    # the estimate within 10% of each recipe's measured peak: every script stays; these add LoRA on the MLP and head
    # (LoRA stays quantized) and plain full fine-tuning (full stays in bf16-mixed)
    "tests/test_estimate.py::test_prediction_within_ten_percent_of_the_measured_peak[finetune/lora.py-options2]",
    "tests/test_estimate.py::test_prediction_within_ten_percent_of_the_measured_peak[finetune/full.py-options5]",
    # validation and samples change no weight: LoRA on nf4-dq stays (nf4 is the same path without the double
    # quantization)
    "tests/test_validation_neutral.py::test_validation_and_samples_every_two_steps_give_the_same_weights[finetune/lora.py-bnb.nf4-lit_model.pth.lora]",
    # several devices with --strategy auto are litgpt's FSDP: full fine-tuning and pretraining stay (LoRA's resolves
    # the strategy in the same place)
    "tests/test_litgpt_meaning.py::test_several_devices_with_strategy_auto_are_litgpts_fsdp[finetune/lora.py-True]",
    # --help shows exactly what each flag accepts: LoRA's and pretraining's stay (the adapters' and full
    # fine-tuning's help is the same parser over a subset of LoRA's flags)
    "tests/test_flags_and_errors.py::test_help_shows_exactly_the_values_each_flag_accepts[finetune/adapter.py]",
    "tests/test_flags_and_errors.py::test_help_shows_exactly_the_values_each_flag_accepts[finetune/adapter_v2.py]",
    "tests/test_flags_and_errors.py::test_help_shows_exactly_the_values_each_flag_accepts[finetune/full.py]",
    # an out_dir in use under FSDP: every rank's one-line refusal stays
    # (test_an_out_dir_in_use_refuses_every_rank_in_one_line); this adds rank 0 held 7 s in an exit handler, past
    # Lightning's watcher
    "tests/test_fsdp.py::test_an_out_dir_in_use_ends_in_its_refusal_also_when_rank_0_is_slow_to_exit",
}


_LONGEST = (
    "tests/test_signature_command.py",  # the README's main job, as typed: two minutes of one worker
    "tests/test_fsdp.py",
    "tests/test_planner.py",
    "tests/test_litgpt_carry_over.py",
    "tests/test_loading.py",
    "tests/test_profiling.py",
)
"""The files with the suite's longest tests and fixtures (``--durations`` of a CI run), started in this order"""


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without the plugin (-p no:xdist) it is not called
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: half as many workers again as cores. A recipe test spends part of its time waiting on the
    processes it starts (torchrun's rendezvous, a server coming up, a signal's delivery). Measured on 2 cores (the
    default tier, tests only): 2 workers 17 min 54 s (the cores 80% busy), 3 workers 16 min 37 s (84%), 4 workers
    17 min 22 s (77%: more workers, more time lost to contention)."""
    cores = os.cpu_count() or 1
    return cores + cores // 2


_FAST_TESTS: set[str] = set()
"""The node ids of the tests not marked slow: a recipe run from one of them fails it (``_runs_a_recipe``)"""


def _runs_a_recipe(what: str) -> None:
    """Fails the current test if it is in the fast tier: it runs ``what``, so it must be marked slow where it is
    written (its module's fixtures run under its name too)."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    if current in _FAST_TESTS:
        pytest.fail(f"{current} runs {what}: mark it @pytest.mark.slow (the fast tier runs no recipe)")


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the marks
def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid in EXTENDED:
            item.add_marker(pytest.mark.extended)
        if item.get_closest_marker("slow") is None:
            _FAST_TESTS.add(item.nodeid)
    # The longest first, the millisecond tests last: pytest-xdist hands out tests in this order, so the second worker
    # fills the end with short tests instead of waiting on one long one (each file's own order is kept, for its
    # module fixtures). FSDP's tests start the most processes.
    rank = {path: i for i, path in enumerate(_LONGEST)}
    items.sort(
        key=lambda item: (item.get_closest_marker("slow") is None, rank.get(item.nodeid.split("::")[0], len(rank)))
    )


def pytest_runtest_logreport(report):
    """With ``MEMFIT_TEST_REPORT`` set, one JSON line per test as it ends (benchmarks/gpu_check.py): a run stopped at
    its time limit writes no JUnit file, and a lent GPU's window has no time to run it again."""
    path = os.environ.get("MEMFIT_TEST_REPORT")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):  # the controller writes every worker's reports
        return
    if report.when != "call" and report.outcome == "passed":
        return
    why = ""
    if report.outcome != "passed":
        text = str(report.longrepr)
        lines = [line for line in text.splitlines() if line.startswith("E ")] or text.splitlines()[-1:]
        why = " | ".join(line[1:].strip() for line in lines[:60])[:8000]  # a GPU miss's role tables
    line = {"test": report.nodeid, "when": report.when, "outcome": report.outcome, "seconds": round(report.duration, 1)}
    with open(path, "a") as f:
        f.write(json.dumps({**line, "why": why}) + "\n")


@pytest.fixture(scope="session", autouse=True)
def memfit_cache(tmp_path_factory):
    """Every test (and every script it starts) generates and shares one embedded default, not the user's cache.
    Under pytest-xdist the workers share the session's: each building its own cost a minute of the 2 CI cores."""
    cache = os.environ.get("MEMFIT_TEST_CACHE")
    if cache is None and os.environ.get("PYTEST_XDIST_WORKER"):
        cache = str(tmp_path_factory.getbasetemp().parent / "memfit-cache")  # the session's dir, above each worker's
    cache = cache or str(tmp_path_factory.mktemp("memfit-cache"))
    os.environ["MEMFIT_CACHE"] = cache
    return Path(cache)


@pytest.fixture(autouse=True)
def in_tmp_dir(tmp_path, monkeypatch):
    """In-process runs and estimates write out/ relative to the working directory: keep it out of the repository."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def embedded(memfit_cache):
    from memfit.training.embedded import ensure_embedded

    return ensure_embedded()


def made_once(tmp_path_factory, name: str, make) -> Path:
    """The dir ``make(dir)`` fills, made once per test session and shared by every pytest-xdist worker, for runs
    several tests only read (a module fixture is made again by each worker that runs one of its tests: the FSDP
    reference runs were made three times in a CI run). A worker that needs it while another makes it waits on the
    lock; a ``make`` that raised leaves no ``.made`` mark, so the next test to ask makes it again and fails itself."""
    import fcntl
    import shutil

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's dir, above each worker's
    made = root / f"made-once-{name}"
    with open(root / f"made-once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (made / ".made").exists():
            shutil.rmtree(made, ignore_errors=True)
            made.mkdir()
            make(made)
            (made / ".made").touch()
    return made


def shared_file(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.skip(f"{path} is absent: the real test data lives in ../shared/data beside the repo")
    return path


@functools.cache
def published_benchmark():
    """benchmarks/estimate_vs_published.py as a module: its litgpt loss, rows and predictions."""
    spec = importlib.util.spec_from_file_location("estimate_vs_published", ROOT / "benchmarks/estimate_vs_published.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    return benchmark


def hub_file(relative: str) -> Path:
    """A file of litgpt's config hub (``finetune/llama-2-7b/qlora.yaml``), or a skip saying where it should be."""
    path = SHARED_HUB / relative
    if not path.is_file():
        pytest.skip(f"{path} is absent: litgpt's config hub lives in ../shared/litgpt_config_hub beside the repo")
    return path


def run_script(
    script: str, *args: str, cwd: Path, timeout: float = 600, env: dict | None = None, fresh: bool = False
) -> subprocess.CompletedProcess:
    """Runs a recipe the way a user does: `python finetune/lora.py ...` in its own process (``env``: added
    variables), offline as users' clusters often are: the run fails the test if it, or a process it starts, tries to
    reach another host (``offline``; a ``PYTHONPATH`` in ``env`` comes after the guard's).

    The process is forked from tests/script_server.py, which has done the recipes' imports once per pytest worker;
    with ``env`` (variables read at import or interpreter start: another CPU emulated, packages hidden), with
    ``fresh`` (what a user sees from a new interpreter, import-time warnings included) or with
    ``MEMFIT_TEST_FRESH_PROCESSES=1`` it is a new interpreter, as a user's is."""
    import tempfile

    _runs_a_recipe(script)
    with tempfile.TemporaryDirectory() as log_dir:
        attempts = Path(log_dir) / "network.log"
        fresh = fresh or env is not None or os.environ.get("MEMFIT_TEST_FRESH_PROCESSES") == "1"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        env.update(offline(attempts, then=env.get("PYTHONPATH")))
        if fresh:
            result = subprocess.run(
                [sys.executable, str(ROOT / script), *args],
                cwd=cwd,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        else:
            result = _forked_run(script, list(args), cwd, env, timeout, Path(log_dir))
        if attempts.exists():
            pytest.fail(f"{script} {' '.join(args)} tried to reach the network: {attempts.read_text()}")
    return result


_server: dict = {}
"""This pytest process's tests/script_server.py: its process and the pipe it answers on"""


def _forked_run(script: str, args: list[str], cwd: Path, env: dict, timeout: float, log_dir: Path):
    """``run_script``'s run, forked from the script server (started on first use, again if it died)."""
    import select
    import signal

    if not _server or _server["process"].poll() is not None:
        read, write = os.pipe()
        # the packages found through PYTHONPATH stay found (the GPU machine's carried wheels are there)
        guard = offline(log_dir / "server-network.log", then=os.environ.get("PYTHONPATH"))
        base = {**os.environ, "PYTHONUNBUFFERED": "1", **guard}
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "tests/script_server.py"), str(write)],
            stdin=subprocess.PIPE,
            pass_fds=(write,),
            env=base,
            text=True,
        )
        os.close(write)
        _server.update(process=process, answers=read, pending=b"")

    def answer(wait: float | None) -> dict | None:
        """The server's next JSON line, read unbuffered (so ``select`` sees what is not yet read); None on timeout."""
        while b"\n" not in _server["pending"]:
            ready, _, _ = select.select([_server["answers"]], [], [], wait)
            if not ready:
                return None
            chunk = os.read(_server["answers"], 4096)
            if not chunk:
                raise RuntimeError("tests/script_server.py ended: its imports failed?")
            _server["pending"] += chunk
        line, _server["pending"] = _server["pending"].split(b"\n", 1)
        return json.loads(line)

    stdout, stderr = log_dir / "stdout", log_dir / "stderr"
    request = {
        "script": script,
        "args": args,
        "cwd": str(cwd),
        "env": env,
        "stdout": str(stdout),
        "stderr": str(stderr),
    }
    _server["process"].stdin.write(json.dumps(request) + "\n")
    _server["process"].stdin.flush()
    pid = answer(None)["pid"]
    ended = answer(timeout)
    if ended is None:  # as subprocess.run's timeout: the run is killed, the test fails with TimeoutExpired
        os.kill(pid, signal.SIGKILL)
        answer(None)
        raise subprocess.TimeoutExpired([script, *args], timeout, stdout.read_text(), stderr.read_text())
    returncode = ended["returncode"]
    return subprocess.CompletedProcess(
        [sys.executable, str(ROOT / script), *args], returncode, stdout.read_text(), stderr.read_text()
    )


def offline(attempts: Path, then: str | None = None) -> dict:
    """The variables of a process that runs as on an air-gapped machine, it and the processes it starts: names do
    not resolve, connections to other hosts are refused, and each attempt is written to ``attempts``
    (tests/offline/sitecustomize.py). ``then``: more of PYTHONPATH, whose own sitecustomize still runs."""
    return {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests/offline"), then])),
        "MEMFIT_TEST_NETWORK_LOG": str(attempts),
    }


def offline_dom(page: Path, profile: Path, width: int = 1200) -> str:
    """The DOM headless Chromium builds from ``page`` in a window ``width`` pixels wide, with every network request
    refused (skips where Debian's chromium is not installed): a page that draws here opens on an air-gapped machine."""
    import shutil

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)")
    return subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={profile}",
            # the network is off: no proxy answers, and no name resolves
            "--proxy-server=127.0.0.1:9",
            "--host-resolver-rules=MAP * ~NOTFOUND",
            f"--window-size={width},800",
            "--virtual-time-budget=15000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    ).stdout


def run_in_process(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """What `python script ...` runs after its imports, ``CLI(setup, args)``, in this process: a refusal costs
    milliseconds instead of the 4-5 s a new process spends importing torch, lightning and litgpt. For refusals and
    short runs; ``run_script`` keeps the real command line for a sample of each kind of mistake
    (test_flags_and_errors.py).

    Warnings go to its stderr as Python's default filters print them in a new process, and so do the lines of the
    loggers that write to stderr (Lightning's "Seed set to ..."), so a test that counts the lines a user sees still
    counts them."""
    import contextlib
    import io
    import logging
    import warnings

    from memfit.settings.cli import CLI

    _runs_a_recipe(script)
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    # a logging.StreamHandler keeps the stderr it was made with (Lightning makes its own at import)
    handlers = {
        handler: handler.stream
        for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        for handler in getattr(logger, "handlers", [])
        if type(handler) is logging.StreamHandler and handler.stream not in (sys.stdout, sys.__stdout__)
    }
    previous = Path.cwd()
    os.chdir(cwd)
    for handler in handlers:
        handler.setStream(stderr)
    try:
        with (
            contextlib.redirect_stdout(stdout),
            contextlib.redirect_stderr(stderr),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.resetwarnings()
            warnings.simplefilter("default")
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)
            try:
                module = load_script(script)
                # as the script's own last line calls it (a fine-tuning script hides the pretraining-only flags)
                CLI(
                    module.setup,
                    list(args),
                    real_model_defaults=getattr(module, "LITGPT_DEFAULTS", None),
                    hidden=getattr(module, "PRETRAINING_ONLY", ()),
                )
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        os.chdir(previous)
        for handler, stream in handlers.items():
            handler.setStream(stream)
    printed = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
    return subprocess.CompletedProcess([script, *args], code, stdout.getvalue(), printed + stderr.getvalue())


def out_of_memory_in(monkeypatch, phase: str) -> None:
    """For a run in this process (``run_in_process``): entering ``phase`` raises PyTorch's own out-of-memory error,
    where an allocation would have failed. A real CPU failure needs an address-space limit (test_estimate.py has
    one): slower, and it cannot pick the phase."""
    import contextlib

    from memfit.memory import MemoryProbe
    from memfit.observatory.phases import PhaseMemory

    unchanged = PhaseMemory.phase

    @contextlib.contextmanager
    def phase_that_fails(self, name: str):
        if name == phase and isinstance(self.probe, MemoryProbe):  # the run's, not the planner's traced steps
            self.current = name  # what the explanation reports the failure against
            raise torch.OutOfMemoryError(f"simulated allocation failure in {name}")
        with unchanged(self, name):
            yield

    monkeypatch.setattr(PhaseMemory, "phase", phase_that_fails)


def instrumentation_fails_in(monkeypatch, phase: str) -> None:
    """For a run in this process: the recorded step fails in ``phase`` as the memory instrumentation failing would.
    In backward it fails from inside autograd's engine half-way (the ledger's hook on the saved tensors raises a few
    tensors in), so some gradients are accumulated and others not; in another phase, at the phase's end."""
    import contextlib

    from memfit.observatory import phases
    from memfit.observatory.roles import SavedActivations

    failure = f"simulated failure of the recorded step in {phase}"
    if phase == "backward":

        class FailingSavedActivations(SavedActivations):
            unpacked = 0

            def _unpack(self, tensor: torch.Tensor) -> torch.Tensor:
                self.unpacked += 1
                if self.unpacked > 3:
                    raise RuntimeError(failure)
                return tensor

        monkeypatch.setattr(phases, "SavedActivations", FailingSavedActivations)
        return
    unchanged = phases.PhaseMemory.phase

    @contextlib.contextmanager
    def phase_that_fails(self, name: str):
        with unchanged(self, name):
            yield
            if name == phase and self.ledger is not None:  # only while the step is recorded
                raise RuntimeError(failure)

    monkeypatch.setattr(phases.PhaseMemory, "phase", phase_that_fails)


def quiet(**overrides) -> dict:
    """``setup()`` keywords of a short, quiet run: 4 steps, a final validation of 2 batches (the default's 20 took a
    quarter of such a run), no profiler, a CSV logger (``overrides`` win)."""
    from memfit.args import EvalArgs, ProfileArgs

    overrides.setdefault("train", tiny_train(max_steps=4))
    overrides.setdefault("eval", EvalArgs(max_iters=2))
    overrides.setdefault("profile", ProfileArgs(enabled=False))
    overrides.setdefault("logger_name", "csv")
    return overrides


def lora_run(tmp_path: Path, **overrides):
    """finetune/lora.py's ``setup()`` in this process, quiet (``quiet``), writing under ``tmp_path``."""
    lora = load_script("finetune/lora.py")
    _runs_a_recipe("finetune/lora.py")
    return lora.setup(out_dir=tmp_path / "out", profile_dir=tmp_path / "profiles", **quiet(**overrides))


def cli_exit(script_module, args: list[str]) -> tuple[int, str]:
    """The exit code and stderr of a command line that must end the run (``SystemExit``), run in this process."""
    import contextlib
    import io

    from memfit.settings.cli import CLI

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exit_info:
        CLI(script_module.setup, args, real_model_defaults=getattr(script_module, "LITGPT_DEFAULTS", None))
    return exit_info.value.code, stderr.getvalue()


def script_summary(script: str, tmp_path: Path, **overrides) -> dict:
    """Runs ``script``'s ``setup()`` in this process, quiet (``quiet``), under ``tmp_path``; returns its summary."""
    _runs_a_recipe(script)
    load_script(script).setup(out_dir=tmp_path / "out", profile_dir=tmp_path / "profiles", **quiet(**overrides))
    return run_summary(tmp_path / "profiles")


def one_process_plan(**settings):
    """A ``memfit.prediction.fake_step.Plan`` on one process with AdamW, no quantization, checkpointing or offload,
    32-true; the
    settings given replace those (``quantize`` and ``optimizer`` by their flag values, as a user gives them)."""
    from memfit.prediction.fake_step import Plan
    from memfit.training.optim import optimizer_kind
    from memfit.training.quantizers import quantize_kind

    base = dict(
        quantize=None,
        optimizer="AdamW",
        activation_checkpointing=False,
        optimizer_in_backward=False,
        strategy="auto",
        cpu_offload=False,
        world_size=1,
        precision="32-true",
        blocks=4,  # the embedded model's depth
    )
    settings = base | settings
    settings["quantize"] = quantize_kind(settings["quantize"]) if settings["quantize"] else None
    settings["optimizer"] = optimizer_kind(settings["optimizer"])
    return Plan(**settings)


def run_summary(profile_dir: Path) -> dict:
    (summary,) = profile_dir.glob("*/summary.json")
    return json.loads(summary.read_text())


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def load_script(relative: str):
    """Imports a recipe script as a module, to call its setup() in-process (faster than a subprocess)."""
    import importlib.util

    name = "memfit_script_" + Path(relative).stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # jsonargparse resolves signatures through the module registry
    spec.loader.exec_module(module)
    return module


def tiny_train(**overrides):
    """A few quick steps: 32-true is fast on CPU; no profiler unless asked."""
    from memfit.args import TrainArgs

    values = dict(
        save_interval=None,
        log_interval=1,
        global_batch_size=8,
        micro_batch_size=4,
        lr_warmup_steps=2,
        max_steps=12,
        lr=3e-3,
    )
    values.update(overrides)
    return TrainArgs(**values)


def step_losses(profile_dir: Path) -> list[float]:
    """The per-step training losses a run logged (TensorBoard events or metrics.csv)."""
    import csv

    (run_dir,) = profile_dir.iterdir()
    csv_files = list(run_dir.glob("metrics.csv"))
    if csv_files:
        return [float(row["loss"]) for row in csv.DictReader(csv_files[0].open()) if row.get("loss")]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return [event.value for event in EventAccumulator(str(run_dir)).Reload().Scalars("loss")]


def loss_fell(losses: list[float], by: float, window: int = 5) -> bool:
    """The mean of the last steps is below the mean of the first ones by ``by``: per-step losses are noisy."""
    return sum(losses[-window:]) / window < sum(losses[:window]) / window - by


def _mount_tmpfs(mount: Path, options: str) -> Path:
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root): the test needs a real disk that is full or read-only")
    return mount


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: a real full disk (needs the rights to mount, as root in CI has)."""
    yield _mount_tmpfs(tmp_path / "small", "size=1m")
    subprocess.run(["umount", "-l", str(tmp_path / "small")], check=False)


@pytest.fixture
def disk(tmp_path):
    """A 64 MiB tmpfs that a test may remount read-only, as a failing disk is."""
    yield _mount_tmpfs(tmp_path / "disk", "size=64m")
    subprocess.run(["umount", "-l", str(tmp_path / "disk")], check=False)


def run_settings(tmp_path: Path, **changes) -> dict:
    """What a script's setup() hands ``memfit.settings.run.Run.of`` once it has resolved its flags, by name: a LoRA on a
    small
    config."""
    from litgpt import Config

    from memfit.args import DDPArgs, EvalArgs, FSDPArgs, LogArgs, ProfileArgs, TrainArgs

    return {
        "checkpoint_dir": tmp_path / "checkpoint",
        "out_dir": tmp_path / "out",
        "profile_dir": tmp_path / "profiles",
        "config": Config(block_size=64, n_layer=2, n_embd=32, n_head=4, vocab_size=100, padded_vocab_size=128),
        "data": None,
        "train": TrainArgs(micro_batch_size=2, global_batch_size=8, max_seq_length=None, max_norm=1.0),
        "eval": EvalArgs(),
        "optimizer": "AdamW8bit",
        "optimizer_args": {"eps": 1e-6},
        "optimizer_in_backward": False,
        "precision": "bf16-true",
        "quantize": "bnb.nf4",
        "accelerator": "cuda",
        "devices": 2,
        "num_nodes": 1,
        "strategy": "fsdp",
        "fsdp": FSDPArgs(cpu_offload=True),
        "ddp": DDPArgs(),
        "activation_checkpointing": True,
        "accumulation": 2,
        "profile": ProfileArgs(),
        "resume_from": None,
        "resume_with_changed_data": False,
        "overwrite": False,
        "seed": 7,
        "hparams": {},
        "memory_budget": None,
        "logger_name": "csv",
        "log": LogArgs(),
        "model_name": None,
        "estimate": False,
        **changes,
    }


def run_and_estimate(script: str, flags: list[str], tmp_path: Path) -> tuple[dict, dict]:
    """``script`` with ``flags`` run for real and then estimated, each a process under ``tmp_path``: the run's
    ledger's phases and the estimate's ``estimate.json``."""
    run = run_script(script, *flags, "--logger_name", "csv", "--out_dir", "out", "--profile_dir", "p", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    measured = json.loads(next((tmp_path / "p").glob("*/ledger.json")).read_text())["phases"]
    estimate = run_script(script, *flags, "--estimate", "true", "--profile_dir", "e", cwd=tmp_path)
    assert estimate.returncode == 0, estimate.stderr[-3000:]
    return measured, json.loads(next((tmp_path / "e").glob("*/estimate.json")).read_text())
