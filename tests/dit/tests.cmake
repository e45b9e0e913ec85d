# tests/dit: the DiT (CoCoDiff): exchanges, families, checkpoints, `diffcp dit`.
# Included by tests/CMakeLists.txt (one directory scope: its variables, functions and the
# label pass at its end apply); ${CMAKE_CURRENT_SOURCE_DIR} is tests/.
add_executable(test_flux_checkpoint dit/test_flux_checkpoint.cpp)
target_link_libraries(test_flux_checkpoint PRIVATE diffcp diffcp_testing GTest::gtest_main)
target_compile_definitions(test_flux_checkpoint PRIVATE DIFFCP_TEST_DATA="${CMAKE_CURRENT_SOURCE_DIR}/data")
gtest_discover_tests(test_flux_checkpoint DISCOVERY_TIMEOUT 60 TEST_PREFIX "test_flux_checkpoint." PROPERTIES LABELS unit)

diffcp_add_mpi_test(test_tapa dit/test_tapa.cpp)

# ---- DiT inference with Ulysses SP (`diffcp dit`, src/dit): Flat / TAPA ----
diffcp_add_mpi_test(test_dit dit/test_dit.cpp)
diffcp_add_mpi_test(test_dit_uneven dit/test_dit_uneven.cpp)
diffcp_add_mpi_test(test_dit_weights dit/test_dit_weights.cpp)
diffcp_add_mpi_test(test_dit_serving dit/test_dit_serving.cpp)
# The run policy as a library session (issue #68): DitRunConfig, plan_generation, DitSession.
diffcp_add_mpi_test(test_dit_session dit/test_dit_session.cpp)
foreach(np 5 6 7)  # any token count at any P: every P up to 8
  add_test(NAME test_dit_uneven_np${np} COMMAND ${MPIRUN} ${np} $<TARGET_FILE:test_dit_uneven>)
  set_tests_properties(test_dit_uneven_np${np} PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 300 LABELS mpi)
endforeach()
diffcp_add_mpi_test(test_dit_guard dit/test_dit_guard.cpp)
diffcp_add_guard_async_test(test_dit_guard 3)
# The fp8 wire (--wire fp8, issue #52): the codec, the exchange in every mode and USP, the bytes.
diffcp_add_mpi_test(test_dit_fp8 dit/test_dit_fp8.cpp)
set(DIT ${MPIRUN} 2 $<TARGET_FILE:diffcp_cli> dit)
set(DIT_TINY --preset tiny --resolution 64 --text-tokens 8 --steps 2)
add_test(NAME cli_dit_tapa_vs_flat COMMAND ${RUN_OK} ${DIT} --steps 2 --compare flat --mode tapa --json --out ${CMAKE_CURRENT_BINARY_DIR}/dit_tapa.png)
set_tests_properties(cli_dit_tapa_vs_flat PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 120
                     PASS_REGULAR_EXPRESSION "^{\"mode\":\"tapa\",\"P\":2,\"group_size\":2,\"steps\":2,\"step_ms\":[0-9.e+-]+,\"bytes_intra_group\":20054016\\.0,\"bytes_inter_group\":0\\.0,\"messages\":12\\.0,\"cache_bytes_per_rank\":0,\"exposed_comm_ms\":[0-9.e+-]+,.*\"psnr\":null,\"ssim\":1\\.0,\"mse\":0\\.0,\"max_abs_diff\":0\\.0[,}]")
add_test(NAME cli_dit_save_latent COMMAND ${RUN_OK} ${DIT} ${DIT_TINY} --mode flat --save-latent ${CMAKE_CURRENT_BINARY_DIR}/dit_flat.npy --out "")
set_tests_properties(cli_dit_save_latent PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60 FIXTURES_SETUP dit_latent
                     PASS_REGULAR_EXPRESSION "weights: RANDOM")
add_test(NAME cli_dit_reference COMMAND ${RUN_OK} ${DIT} ${DIT_TINY} --mode tapa --group-size 1 --json --out ""
                                        --reference ${CMAKE_CURRENT_BINARY_DIR}/dit_flat.npy)
set_tests_properties(cli_dit_reference PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60 FIXTURES_REQUIRED dit_latent
                     PASS_REGULAR_EXPRESSION "\"max_abs_diff\":0\\.0[,}]")
# Issue #54: the bf16 GEMMs' packed weights change nothing: without them, bit for bit the same image.
add_test(NAME cli_dit_bf16_save_latent COMMAND ${RUN_OK} ${DIT} ${DIT_TINY} --dtype bf16 --mode flat
         --save-latent ${CMAKE_CURRENT_BINARY_DIR}/dit_bf16.npy --out "")
set_tests_properties(cli_dit_bf16_save_latent PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
                     FIXTURES_SETUP dit_bf16_latent PASS_REGULAR_EXPRESSION "weights: RANDOM")
add_test(NAME cli_dit_bf16_no_pack_weights COMMAND ${RUN_OK} ${DIT} ${DIT_TINY} --dtype bf16 --mode flat --no-pack-weights
         --json --out "" --reference ${CMAKE_CURRENT_BINARY_DIR}/dit_bf16.npy)
set_tests_properties(cli_dit_bf16_no_pack_weights PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
                     FIXTURES_REQUIRED dit_bf16_latent PASS_REGULAR_EXPRESSION "\"max_abs_diff\":0\\.0[,}]")
diffcp_add_fail_test(cli_dit_profile_one_step "--profile times the steps after the first" ${DIT} --preset tiny --resolution 64 --text-tokens 8 --steps 1 --profile)
# --profile: every op family of the step timed, in the documented order.
add_test(NAME cli_dit_profile COMMAND ${RUN_OK} ${DIT} ${DIT_TINY} --profile --json --out "")
set_tests_properties(cli_dit_profile PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60 PASS_REGULAR_EXPRESSION
  "\"profile_ms_per_step\":{\"conditioning\":[0-9.e+-]+,\"layernorm_mod\":[0-9.e+-]+,\"gemm\":[0-9.e+-]+,\"qk_norm_rope\":[0-9.e+-]+,\"attention\":[0-9.e+-]+,\"activation\":[0-9.e+-]+,\"gated_add\":[0-9.e+-]+,\"final_layer\":[0-9.e+-]+}")
# dense_linear where oneDNN has no bf16 matmul (capped at AVX2): the converted path, packed == stored, fp64 bound.
add_test(NAME dense_linear_bf16_converted COMMAND test_dit_weights --gtest_filter=DitWeightPacking.*)
set_tests_properties(dense_linear_bf16_converted PROPERTIES ENVIRONMENT "OMP_NUM_THREADS=2;DNNL_MAX_CPU_ISA=AVX2;${DIFFCP_MPI_ENV}")
diffcp_add_fail_test(cli_dit_unknown_mode "--mode 'ring': unknown mode" ${DIT} ${DIT_TINY} --mode ring)
diffcp_add_fail_test(cli_dit_bad_dtype "--dtype 'fp16': expected f32 or bf16" ${DIT} ${DIT_TINY} --dtype fp16)
diffcp_add_fail_test(cli_dit_bad_wire "--wire 'e5m2': unknown wire format, expected auto" ${DIT} ${DIT_TINY} --wire e5m2)
# --wire fp8 (issue #52): judged by PSNR (no tolerance check), the scale bytes reported and predicted.
add_test(NAME cli_dit_fp8_wire COMMAND ${JSON_CHECK}
         "j['wire'] == 'fp8'" "j['scale_bytes'] > 0 and j['scale_bytes'] == j['predicted_scale_bytes']"
         "j['check_passed'] is None and j['tolerance'] is None" "isinstance(j['psnr'], float) and j['psnr'] > 40"
         -- ${DIT} ${DIT_TINY} --mode vfirst --wire fp8 --compare flat --json --out "")
set_tests_properties(cli_dit_fp8_wire PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
                     PASS_REGULAR_EXPRESSION "json_check: passed")
# bf16 USP (Ulysses degree 1, Ring degree 2): Ring's K|V hops in bf16, 8 x 16 x 128 bytes a step
# (the f32 run moves 24576).
add_test(NAME cli_dit_bf16_usp_ring COMMAND ${RUN_OK} ${DIT} ${DIT_TINY} --dtype bf16 --ulysses-degree 1 --json --out "")
set_tests_properties(cli_dit_bf16_usp_ring PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
                     PASS_REGULAR_EXPRESSION "\"ring_bytes\":12288.0,\"predicted_ring_bytes\":12288.0")
# Sharded bf16 weights in a run: the allocation and the gathered bytes equal their closed forms
# (dit_weight_bytes, dit_gather_bytes for the tiny preset at P = 2), and the image equals the flat
# reference's bit for bit (check_passed, max error 0).
add_test(NAME cli_dit_shard_weights COMMAND ${RUN_OK} ${DIT} ${DIT_TINY} --weights-dtype bf16 --shard-weights --mode vfirst
         --compare flat --json --out "")
set_tests_properties(cli_dit_shard_weights PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
  PASS_REGULAR_EXPRESSION "\"weights_bytes_per_rank\":2013120,\"predicted_weights_bytes_per_rank\":2013120,\"weight_gather_bytes\":638976\\.0,\"predicted_weight_gather_bytes\":638976\\.0,.*\"check_passed\":true,\"max_abs_err\":0\\.0")
# Issue #52: FLUX.1 true CFG with the two passes on two halves of 4 ranks (--compare flat: the
# sequential flat run over all 4 ranks), the velocity pair's bytes the closed form (16 image tokens,
# 8 per rank of a half, C_in 16: 512 bytes a step); threshold-0 step caching bitwise the exact run.
add_test(NAME cli_dit_cfg_parallel COMMAND ${RUN_OK} ${MPIRUN} 4 $<TARGET_FILE:diffcp_cli> dit ${DIT_TINY} --true-cfg-scale 3
         --cfg-parallel --mode vfirst --compare flat --json --out "")
set_tests_properties(cli_dit_cfg_parallel PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
  PASS_REGULAR_EXPRESSION "\"cfg_passes\":2,\"true_cfg_scale\":3\\.0,\"cfg_parallel\":true,\"cfg_pair_bytes\":512\\.0,\"predicted_cfg_pair_bytes\":512\\.0,.*\"check_passed\":true")
# CFG-parallel with the fp8 wire: each half's scale bytes, averaged over the ranks, are the closed form's.
add_test(NAME cli_dit_cfg_parallel_fp8 COMMAND ${RUN_OK} ${MPIRUN} 4 $<TARGET_FILE:diffcp_cli> dit ${DIT_TINY} --true-cfg-scale 3
         --cfg-parallel --wire fp8 --mode tapa --json --out "")
set_tests_properties(cli_dit_cfg_parallel_fp8 PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
  PASS_REGULAR_EXPRESSION "\"wire\":\"fp8\",\"scale_bytes\":1536\\.0,\"predicted_scale_bytes\":1536\\.0")
add_test(NAME cli_dit_step_cache_zero COMMAND ${RUN_OK} ${DIT} ${DIT_TINY} --mode tapa --step-cache fbcache:0 --compare flat --json --out "")
set_tests_properties(cli_dit_step_cache_zero PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
  PASS_REGULAR_EXPRESSION "\"step_cache\":\"fbcache:0\",\"steps_computed\":\\[2\\],\"steps_cached\":\\[0\\],.*\"check_passed\":true,\"max_abs_err\":0\\.0")
diffcp_add_fail_test(cli_dit_cfg_parallel_odd "P = 3 is odd" ${MPIRUN} 3 $<TARGET_FILE:diffcp_cli> dit ${DIT_TINY} --true-cfg-scale 3 --cfg-parallel)
diffcp_add_fail_test(cli_dit_cfg_parallel_one_pass "--cfg-parallel: this run has no negative pass.*--true-cfg-scale <= 1" ${DIT} ${DIT_TINY} --cfg-parallel)
diffcp_add_fail_test(cli_dit_step_cache_bad "--step-cache 'fbcache:x': the threshold 'x' is not a finite number" ${DIT} ${DIT_TINY} --step-cache fbcache:x)
diffcp_add_fail_test(cli_dit_step_cache_one_block "First-Block Cache needs at least two" ${DIT} ${DIT_TINY} --step-cache fbcache:0.1
                     --double-blocks 1 --single-blocks 0)
diffcp_add_fail_test(cli_dit_weights_dtype_bad "--weights-dtype 'f16': expected auto, f32 or bf16" ${DIT} ${DIT_TINY} --weights-dtype f16)
diffcp_add_fail_test(cli_dit_shard_weights_f32_bf16 "--shard-weights with bf16 compute needs the weights stored in bf16: --weights-dtype bf16"
                     ${DIT} ${DIT_TINY} --shard-weights --dtype bf16)
diffcp_add_fail_test(cli_dit_heads_not_divisible "Ulysses degree U = 2 does not divide the 5 attention heads" ${DIT} ${DIT_TINY} --heads 5 --ulysses-degree 2)
# Token counts P does not divide run with padding rows (issue #35), equal to the one-rank run.
add_test(NAME cli_dit_tokens_not_divisible COMMAND ${RUN_OK} ${DIT} --preset tiny --resolution 64 --text-tokens 7 --steps 2
         --mode tapa --compare flat --json --out "")
set_tests_properties(cli_dit_tokens_not_divisible PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
                     PASS_REGULAR_EXPRESSION "\"text_tokens\":7,.*\"check_passed\":true")
diffcp_add_fail_test(cli_dit_group_not_divisible "--group-size L = 3 does not divide P = 2" ${DIT} ${DIT_TINY} --mode tapa --group-size 3)
diffcp_add_fail_test(cli_dit_missing_weights "safetensors '/nonexistent/dit.safetensors': cannot open" ${DIT} ${DIT_TINY} --weights /nonexistent/dit.safetensors)
diffcp_add_fail_test(cli_dit_malformed_weights "safetensors '.*CMakeLists.txt'" ${DIT} ${DIT_TINY} --weights ${CMAKE_CURRENT_SOURCE_DIR}/CMakeLists.txt)
diffcp_add_fail_test(cli_dit_bad_resolution "image 100x100 pixels, expected positive multiples of 16" ${DIT} --preset tiny --resolution 100)
# ---- `diffcp dit` V-First / CoCoDiff (issue #7 part 2); the "not yet" test above is obsolete ----
add_test(NAME cli_dit_vfirst_vs_flat COMMAND ${RUN_OK} ${DIT} ${DIT_TINY} --mode vfirst --group-size 2 --compare flat --json --out "")
set_tests_properties(cli_dit_vfirst_vs_flat PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60 PASS_REGULAR_EXPRESSION "\"psnr\":null")
add_test(NAME cli_dit_cocodiff_r0_vs_flat COMMAND ${RUN_OK} ${DIT} ${DIT_TINY} --mode cocodiff --group-size 1 --cache-schedule fixed
                                          --cache-ratio 0 --warmup 0 --sync-every 0 --compare flat --json --out "")
set_tests_properties(cli_dit_cocodiff_r0_vs_flat PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60 PASS_REGULAR_EXPRESSION "\"psnr\":null")
add_test(NAME cli_dit_cocodiff_linear COMMAND ${RUN_OK} ${DIT} --preset tiny --resolution 64 --text-tokens 8 --steps 12 --warmup 2 --sync-every 5 --mode cocodiff --group-size 1 --compare flat --out "")
set_tests_properties(cli_dit_cocodiff_linear PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
                     PASS_REGULAR_EXPRESSION "bytes across groups 19107 predicted, 19107 measured; TAPA/CoCoDiff 1.286x predicted, 1.286x measured")
diffcp_add_fail_test(cli_dit_cache_ratio_above_one "--cache-ratio = 1.5, expected a cache ratio r in \\[0, 1\\]" ${DIT} ${DIT_TINY} --mode cocodiff --cache-ratio 1.5)
diffcp_add_fail_test(cli_dit_cache_ratio_negative "--cache-ratio = -0.2, expected a cache ratio r in \\[0, 1\\]" ${DIT} ${DIT_TINY} --mode cocodiff --cache-ratio=-0.2)
diffcp_add_fail_test(cli_dit_unknown_schedule "--cache-schedule 'cosine': unknown schedule" ${DIT} ${DIT_TINY} --mode cocodiff --cache-schedule cosine)
# ---- `diffcp dit` on FLUX-format checkpoints (issue #19): numpy's FLUX reference, bad inputs ----
set(FLUX_REF ${PROJECT_SOURCE_DIR}/tools/flux_reference.py)
add_test(NAME flux_numpy_check COMMAND ${RUN_OK} ${CMAKE_CURRENT_SOURCE_DIR}/dit/flux_numpy_check.sh $<TARGET_FILE:diffcp_cli>)
set_tests_properties(flux_numpy_check PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 240
                     PASS_REGULAR_EXPRESSION "flux_numpy_check: passed")
# FLUX.1-dev's real shape read off a full-size header (a sparse 23.8 GB file without data).
set(FLUX_DIR ${CMAKE_CURRENT_BINARY_DIR}/flux_fixture)
add_test(NAME flux_fixture COMMAND sh -c "rm -rf '${FLUX_DIR}' && '${DIFFCP_PYTHON}' '${FLUX_REF}' make --out '${FLUX_DIR}' --dtype bf16 --shards 2 && '${DIFFCP_PYTHON}' '${FLUX_REF}' header --config '${CMAKE_CURRENT_SOURCE_DIR}/data/flux1-dev.json' --out '${FLUX_DIR}/flux1-dev-header.safetensors' && '${DIFFCP_PYTHON}' -c \"import numpy as n; n.save('${FLUX_DIR}/txt_bad.npy', n.zeros((8, 7), n.float32)); n.save('${FLUX_DIR}/noise_bad.npy', n.zeros((1, 5, 16), n.float32))\" && printf '{\"num_layers\": 19}' > '${FLUX_DIR}/diffusers.json'")
set_tests_properties(flux_fixture PROPERTIES FIXTURES_SETUP flux_files TIMEOUT 60)
add_test(NAME cli_dit_flux1_real_shape_dry_run COMMAND ${RUN_OK} ${DIT} --weights ${FLUX_DIR}/flux1-dev-header.safetensors --dry-run --json --resolution 1024 --text-tokens 512)
set_tests_properties(cli_dit_flux1_real_shape_dry_run PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60 FIXTURES_REQUIRED flux_files
  PASS_REGULAR_EXPRESSION "\"double_blocks\":19.*\"heads\":24.*\"hidden\":3072.*\"parameters\":11901408320")
set(FLUX_IN --weights ${FLUX_DIR}/model.safetensors.index.json --steps 2)  # each fails before it would write an image
diffcp_add_fail_test(cli_dit_flux_txt_without_pooled "--text-embeddings and --pooled come together" ${DIT} ${FLUX_IN} --text-embeddings ${FLUX_DIR}/txt.npy)
diffcp_add_fail_test(cli_dit_flux_bad_txt "--text-embeddings '.*txt_bad.npy': shape \\[8, 7\\], expected \\[T, context_in_dim\\] or \\[1, T, context_in_dim\\] with context_in_dim = 32"
          ${DIT} ${FLUX_IN} --text-embeddings ${FLUX_DIR}/txt_bad.npy --pooled ${FLUX_DIR}/pooled.npy)
diffcp_add_fail_test(cli_dit_flux_bad_noise "--noise '.*noise_bad.npy': 5 image tokens, but a 64x32 image has \\(32/16\\) x \\(64/16\\) = 8"
          ${DIT} ${FLUX_IN} --noise ${FLUX_DIR}/noise_bad.npy --width 64 --height 32)
diffcp_add_fail_test(cli_dit_flux_batch_disagrees "--batch 2 disagrees with --noise" ${DIT} ${FLUX_IN} --noise ${FLUX_DIR}/noise.npy --width 64 --height 32 --batch 2)
diffcp_add_fail_test(cli_dit_flux_heads_disagree "--heads 8 disagrees with the checkpoint: hidden 64 / head dim 16" ${DIT} ${FLUX_IN} --heads 8)
diffcp_add_fail_test(cli_dit_flux_config_diffusers "unknown field 'num_layers'.*diffusers" ${DIT} ${FLUX_IN} --config ${FLUX_DIR}/diffusers.json)
diffcp_add_fail_test(cli_dit_flux_config_and_preset "--config '.*' gives the model shape: drop --preset" ${DIT} ${FLUX_IN} --config ${FLUX_DIR}/config.json --preset tiny)
diffcp_add_fail_test(cli_dit_flux_preset_mismatch "weights '.*index.json' do not match the model" ${DIT} ${FLUX_IN} --preset tiny)
foreach(t IN ITEMS cli_dit_flux_txt_without_pooled cli_dit_flux_bad_txt cli_dit_flux_bad_noise cli_dit_flux_batch_disagrees cli_dit_flux_heads_disagree cli_dit_flux_config_diffusers cli_dit_flux_config_and_preset cli_dit_flux_preset_mismatch)
  set_tests_properties(${t} PROPERTIES FIXTURES_REQUIRED flux_files)
endforeach()
# diffusers folders (issue #34): bad configs and files are named (tests/diffusers_fixture.sh).
set(DIFFUSERS_DIR ${CMAKE_CURRENT_BINARY_DIR}/diffusers_fixture)
add_test(NAME diffusers_fixture COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/dit/diffusers_fixture.sh ${DIFFCP_PYTHON} ${DIFFUSERS_DIR})
set_tests_properties(diffusers_fixture PROPERTIES FIXTURES_SETUP diffusers_files TIMEOUT 60)
diffcp_add_fail_test(cli_dit_diffusers_other_class "_class_name 'HunyuanDiT2DModel' is not a DiT diffcp runs; supported: FluxTransformer2DModel"
                     ${DIT} --weights ${DIFFUSERS_DIR}/bad_class --dry-run)
diffcp_add_fail_test(cli_dit_diffusers_unknown_field "unknown field 'mlp_ratio' for FluxTransformer2DModel" ${DIT} --weights ${DIFFUSERS_DIR}/bad_field --dry-run)
diffcp_add_fail_test(cli_dit_diffusers_missing_tensors "    'transformer_blocks.1.attn.to_q.weight' \\[64, 64\\]"
                     ${DIT} --weights ${DIFFUSERS_DIR}/deeper --dry-run)
diffcp_add_fail_test(cli_dit_diffusers_no_config "a folder without model_index.json or config.json" ${DIT} --weights ${DIFFUSERS_DIR}/empty --dry-run)
diffcp_add_fail_test(cli_dit_diffusers_and_preset "is a diffusers folder: its config.json gives the model shape; drop --config / --preset"
                     ${DIT} --weights ${DIFFUSERS_DIR}/pipe --preset tiny --dry-run)
# Qwen-Image, FLUX.2, SD3.5 (issue #34) and Wan (issue #70): the NumPy references of diffusers'
# QwenImageTransformer2DModel / Flux2Transformer2DModel / SD3Transformer2DModel / WanTransformer3DModel and their pipelines, the published models' real shapes,
# bad inputs.
foreach(family IN ITEMS qwen_image flux2 sd3 wan)
  add_test(NAME ${family}_numpy_check COMMAND ${RUN_OK} ${CMAKE_CURRENT_SOURCE_DIR}/dit/family_numpy_check.sh ${family} $<TARGET_FILE:diffcp_cli>)
  set_tests_properties(${family}_numpy_check PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 240
                       PASS_REGULAR_EXPRESSION "family_numpy_check ${family}: passed")
endforeach()
add_test(NAME cli_dit_qwen_image_real_shape_dry_run COMMAND ${RUN_OK} ${DIT} --weights ${DIFFUSERS_DIR}/qwen-image --dry-run --json
         --width 1664 --height 928 --text-tokens 256 --guidance 1)
set_tests_properties(cli_dit_qwen_image_real_shape_dry_run PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60 FIXTURES_REQUIRED diffusers_files
  PASS_REGULAR_EXPRESSION "\"double_blocks\":60,.*\"family\":\"qwen_image\".*\"heads\":24,.*\"hidden\":3072,.*\"single_blocks\":0,.*\"parameters\":20430401088")
# Wan (issue #70): Wan2.1-T2V-1.3B's real shape (480p, 81 frames: 21 latent frames of 60 x 104, 32,760
# tokens; 512 text tokens), the image-to-video variant refused by name, --frames on an image model.
add_test(NAME cli_dit_wan_real_shape_dry_run COMMAND ${RUN_OK} ${DIT} --weights ${DIFFUSERS_DIR}/wan2.1-1.3b --dry-run --json
         --width 832 --height 480 --frames 21 --text-tokens 512 --guidance 1)
set_tests_properties(cli_dit_wan_real_shape_dry_run PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60 FIXTURES_REQUIRED diffusers_files
  PASS_REGULAR_EXPRESSION "\"family\":\"wan\".*\"heads\":12,.*\"hidden\":1536,.*\"mlp_hidden\":8960,.*\"rope_axes\":\\[44,42,42\\],.*\"single_blocks\":30,.*\"parameters\":1418996800")
# Wan 2.2 TI2V-5B's transformer (48 latent channels, 24 heads x 128, 30 blocks): 4,999,787,712 parameters
# (counted from its config by hand: blocks 2 (4 D^2 + 6 D) + 2 D + 2 D F + F + D + 6 D, the embeddings and
# proj_out), at 720p, 121 frames: its 16x VAE's latent is 31 x 44 x 80 (27,280 tokens); diffcp's --width /
# --height are 8x the latent's sides (640 x 352), as for the 8x VAEs.
add_test(NAME cli_dit_wan22_ti2v_5b_real_shape_dry_run COMMAND ${RUN_OK} ${DIT} --weights ${DIFFUSERS_DIR}/wan2.2-ti2v-5b
         --dry-run --json --width 640 --height 352 --frames 31 --text-tokens 512 --guidance 1)
set_tests_properties(cli_dit_wan22_ti2v_5b_real_shape_dry_run PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
  FIXTURES_REQUIRED diffusers_files
  PASS_REGULAR_EXPRESSION "\"family\":\"wan\".*\"heads\":24,.*\"hidden\":3072,.*\"parameters\":4999787712,.*\"image_tokens\":27280")
# A video's --compare flat (the latent frames as images) and its report's frames.
add_test(NAME cli_dit_wan_compare_flat COMMAND ${RUN_OK} ${DIT} --weights ${DIFFUSERS_DIR}/wan --text-embeddings ${DIFFUSERS_DIR}/wan/txt.npy
         --noise ${DIFFUSERS_DIR}/wan/noise.npy --width 64 --height 48 --steps 2 --guidance 1 --mode tapa --group-size 1
         --compare flat --json --out ${CMAKE_CURRENT_BINARY_DIR}/dit_wan.png)
set_tests_properties(cli_dit_wan_compare_flat PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60 FIXTURES_REQUIRED diffusers_files
  PASS_REGULAR_EXPRESSION "\"frames\":3,.*\"ssim\":1\\.0,\"mse\":0\\.0")
# Wan on the device doubles (the guard devices, stream order included: bitwise the CPU's latent;
# CoCoDiff's selective steps, sharded bf16 weights) and on the rendezvous communicator (NCCL's
# semantics at P = 3: bitwise MPI's).
add_test(NAME cli_dit_wan_device_doubles COMMAND ${RUN_OK} ${CMAKE_COMMAND} -E env bash -c
  "set -e; d=$(mktemp -d); trap 'rm -rf $d' EXIT; w=${DIFFUSERS_DIR}/wan; \
   in=\"--weights $w --text-embeddings $w/txt.npy --negative-text-embeddings $w/neg.npy --noise $w/noise.npy --width 64 --height 48 --steps 3\"; \
   for b in cpu guard guard-async; do ${MPIEXEC_EXECUTABLE} -np 2 $<TARGET_FILE:diffcp_cli> --backend $b dit $in --mode cocodiff \
     --cache-schedule fixed --cache-ratio 0.5 --warmup 0 --weights-dtype bf16 --shard-weights --out '' --save-latent $d/$b.npy; done; \
   cmp $d/cpu.npy $d/guard.npy && cmp $d/cpu.npy $d/guard-async.npy; \
   for c in mpi rendezvous; do ${MPIEXEC_EXECUTABLE} --oversubscribe -np 3 $<TARGET_FILE:diffcp_cli> dit --comm $c $in --mode vfirst \
     --group-size 1 --out '' --save-latent $d/$c.npy; done; cmp $d/mpi.npy $d/rendezvous.npy && echo 'latents equal'")
set_tests_properties(cli_dit_wan_device_doubles PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 120 FIXTURES_REQUIRED diffusers_files
                     PASS_REGULAR_EXPRESSION "latents equal" FAIL_REGULAR_EXPRESSION "run_ok: FAILED")
# Wan image-to-video (Wan2.1-I2V-14B-480P's transformer: 36 input channels, a CLIP image context): its
# real shape, 16,394,878,784 parameters as diffusers' own WanTransformer3DModel counts them (built on
# the meta device from this config); sampling it from the CLI is refused (its condition needs the VAE
# encoder and CLIP: the pipeline runs it), and an image_dim without added_kv_proj_dim by name.
add_test(NAME cli_dit_wan21_i2v_14b_real_shape_dry_run COMMAND ${RUN_OK} ${DIT} --weights ${DIFFUSERS_DIR}/wan2.1-i2v-14b
         --dry-run --json --width 832 --height 480 --frames 21 --text-tokens 512 --guidance 1)
set_tests_properties(cli_dit_wan21_i2v_14b_real_shape_dry_run PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
  FIXTURES_REQUIRED diffusers_files
  PASS_REGULAR_EXPRESSION "\"condition_channels\":20,.*\"image_dim\":1280,.*\"latent_channels\":16,.*\"parameters\":16394878784")
diffcp_add_fail_test(cli_dit_wan_i2v_refused "is a Wan image-to-video transformer \\(in_channels 12 = the latent's 4 \\+ the condition's 8, a CLIP image context of 20 features\\).*diffcp.diffusers.parallelize\\(WanImageToVideoPipeline\\)"
                     ${DIT} --weights ${DIFFUSERS_DIR}/wan_i2v)
diffcp_add_fail_test(cli_dit_wan_half_i2v "image_dim = 1280, added_kv_proj_dim = null, .*image_dim and added_kv_proj_dim = the hidden size \\(48\\) together"
                     ${DIT} --weights ${DIFFUSERS_DIR}/wan_half_i2v --dry-run)
diffcp_add_fail_test(cli_dit_wan22_two_experts "model_index.json's transformer_2 = .* is not supported: diffcp runs one transformer"
                     ${DIT} --weights ${DIFFUSERS_DIR}/wan22_a14b --dry-run)
diffcp_add_fail_test(cli_dit_wan_unipc_noise_prediction "field 'prediction_type' = .epsilon., expected .flow_prediction."
                     ${DIT} --weights ${DIFFUSERS_DIR}/wan_unipc_eps --dry-run)
diffcp_add_fail_test(cli_dit_wan_beyond_rope "1100 latent frames of 30 x 52 tokens, beyond the model's RoPE table of 1024 positions"
                     ${DIT} --weights ${DIFFUSERS_DIR}/wan2.1-1.3b --dry-run --width 832 --height 480 --frames 1100 --text-tokens 512)
diffcp_add_fail_test(cli_dit_frames_on_image_model "--frames 3: flux1 is an image model \\(one frame\\); the video family is wan"
                     ${DIT} --preset tiny --frames 3 --dry-run)
add_test(NAME cli_dit_flux2_dev_real_shape_dry_run COMMAND ${RUN_OK} ${DIT} --weights ${DIFFUSERS_DIR}/flux2-dev --dry-run --json
         --resolution 1024 --text-tokens 512)
set_tests_properties(cli_dit_flux2_dev_real_shape_dry_run PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60 FIXTURES_REQUIRED diffusers_files
  PASS_REGULAR_EXPRESSION "\"double_blocks\":8,.*\"family\":\"flux2\".*\"heads\":48,.*\"hidden\":6144,.*\"mlp_hidden\":18432,.*\"single_blocks\":48,.*\"parameters\":32223281152")
diffcp_add_fail_test(cli_dit_flux2_pooled "--pooled: this model \\(flux2\\) has no pooled text vector"
                     ${DIT} --weights ${DIFFUSERS_DIR}/flux2 --text-embeddings ${DIFFUSERS_DIR}/flux2/txt.npy --pooled ${DIFFUSERS_DIR}/flux2/txt.npy --dry-run)
diffcp_add_fail_test(cli_dit_flux2_three_axes "3 RoPE axes, but the positions \\(frame, row, column, text index\\) need 4"
                     ${DIT} --weights ${DIFFUSERS_DIR}/flux2_axes --dry-run)
diffcp_add_fail_test(cli_dit_flux2_schnell_guidance "--guidance 4: this model has no guidance_in"
                     ${DIT} --weights ${DIFFUSERS_DIR}/flux2_noguid --guidance 4 --dry-run)
add_test(NAME cli_dit_sd35_large_real_shape_dry_run COMMAND ${RUN_OK} ${DIT} --weights ${DIFFUSERS_DIR}/sd3.5-large --dry-run --json
         --resolution 1024 --text-tokens 334 --ulysses-degree 2 --guidance 1)
set_tests_properties(cli_dit_sd35_large_real_shape_dry_run PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60 FIXTURES_REQUIRED diffusers_files
  PASS_REGULAR_EXPRESSION "\"double_blocks\":38,.*\"family\":\"sd3\".*\"heads\":38,.*\"hidden\":2432,.*\"pos_embed_max\":192,.*\"parameters\":8146280768")
set(SD3_IN --weights ${DIFFUSERS_DIR}/sd3 --steps 1 --width 64 --height 48)
diffcp_add_fail_test(cli_dit_sd3_negative_without_pooled "--negative-text-embeddings and --negative-pooled come together"
                     ${DIT} ${SD3_IN} --text-embeddings ${DIFFUSERS_DIR}/sd3/txt.npy --pooled ${DIFFUSERS_DIR}/sd3/pooled.npy
                     --negative-text-embeddings ${DIFFUSERS_DIR}/sd3/neg.npy)
diffcp_add_fail_test(cli_dit_sd3_packed_noise "--noise '.*sd3/txt.npy': shape \\[8, 32\\], expected \\[b, C, H/8, W/8\\] with C = in_channels = 4"
                     ${DIT} ${SD3_IN} --noise ${DIFFUSERS_DIR}/sd3/txt.npy)
diffcp_add_fail_test(cli_dit_sd3_beyond_position_table "beyond SD3's position table of 8 x 8"
                     ${DIT} --weights ${DIFFUSERS_DIR}/sd3 --resolution 256 --text-tokens 8 --dry-run)
diffcp_add_fail_test(cli_dit_sd3_dual_attention "dual_attention_layers = \\[0\\] is not supported"
                     ${DIT} --weights ${DIFFUSERS_DIR}/sd3_dual --dry-run)
set(QWEN_IN --weights ${DIFFUSERS_DIR}/qwen --steps 2 --width 64 --height 48)
diffcp_add_fail_test(cli_dit_qwen_one_step_terminal "shift_terminal = 0.02 needs --steps >= 2"
                     ${DIT} --weights ${DIFFUSERS_DIR}/qwen --steps 1 --width 64 --height 48 --text-tokens 8 --dry-run)
diffcp_add_fail_test(cli_dit_qwen_pooled "--pooled: this model \\(qwen_image\\) has no pooled text vector"
                     ${DIT} ${QWEN_IN} --text-embeddings ${DIFFUSERS_DIR}/qwen/txt.npy --pooled ${DIFFUSERS_DIR}/qwen/txt.npy)
diffcp_add_fail_test(cli_dit_qwen_cfg_without_negative "--guidance 4: classifier-free guidance needs the negative prompt's embeddings"
                     ${DIT} ${QWEN_IN} --text-embeddings ${DIFFUSERS_DIR}/qwen/txt.npy)
diffcp_add_fail_test(cli_dit_qwen_negative_without_cfg "--negative-text-embeddings is read only with --guidance > 1"
                     ${DIT} ${QWEN_IN} --text-embeddings ${DIFFUSERS_DIR}/qwen/txt.npy --negative-text-embeddings ${DIFFUSERS_DIR}/qwen/neg.npy --guidance 1)
# The negative prompt's 5 tokens at P = 2: padding in the negative pass too, equal to the one-rank run.
add_test(NAME cli_dit_qwen_negative_not_divisible COMMAND ${RUN_OK} ${DIT} ${QWEN_IN} --text-embeddings ${DIFFUSERS_DIR}/qwen/txt.npy
         --negative-text-embeddings ${DIFFUSERS_DIR}/qwen/neg.npy --compare flat --json --out "")
set_tests_properties(cli_dit_qwen_negative_not_divisible PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
                     PASS_REGULAR_EXPRESSION "\"cfg_passes\":2,.*\"check_passed\":true")
# FLUX.1 takes a negative prompt only for its true CFG (--true-cfg-scale > 1, FluxPipeline's true_cfg_scale).
diffcp_add_fail_test(cli_dit_flux_negative "--negative-text-embeddings is read only with --true-cfg-scale > 1"
                     ${DIT} --weights ${DIFFUSERS_DIR}/pipe --text-embeddings ${DIFFUSERS_DIR}/pipe/txt.npy --pooled ${DIFFUSERS_DIR}/pipe/pooled.npy
                     --negative-text-embeddings ${DIFFUSERS_DIR}/pipe/txt.npy --negative-pooled ${DIFFUSERS_DIR}/pipe/pooled.npy --dry-run)
diffcp_add_fail_test(cli_dit_qwen_zero_cond "zero_cond_t = true is not supported" ${DIT} --weights ${DIFFUSERS_DIR}/qwen_zero_cond --dry-run)
diffcp_add_fail_test(cli_dit_qwen_guidance_embeds "guidance_embeds = true is not supported.*takes no guidance"
                     ${DIT} --weights ${DIFFUSERS_DIR}/qwen_guidance --dry-run)
foreach(t IN ITEMS cli_dit_qwen_pooled cli_dit_qwen_cfg_without_negative cli_dit_qwen_negative_without_cfg cli_dit_qwen_negative_not_divisible
                   cli_dit_flux_negative cli_dit_qwen_zero_cond cli_dit_qwen_guidance_embeds cli_dit_flux2_pooled cli_dit_flux2_three_axes
                   cli_dit_flux2_schnell_guidance cli_dit_sd3_negative_without_pooled cli_dit_sd3_packed_noise
                   cli_dit_sd3_beyond_position_table cli_dit_sd3_dual_attention cli_dit_qwen_one_step_terminal cli_dit_wan_i2v_refused cli_dit_wan_half_i2v
                   cli_dit_wan22_two_experts cli_dit_wan_beyond_rope cli_dit_wan_unipc_noise_prediction)
  set_tests_properties(${t} PROPERTIES FIXTURES_REQUIRED diffusers_files)
endforeach()
add_test(NAME cli_dit_diffusers_dry_run COMMAND ${RUN_OK} ${DIT} --weights ${DIFFUSERS_DIR}/pipe --dry-run --json --width 64 --height 32 --text-tokens 8)
set_tests_properties(cli_dit_diffusers_dry_run PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
  PASS_REGULAR_EXPRESSION "\"double_blocks\":1.*\"guidance_embed\":true.*\"heads\":4.*\"hidden\":64.*\"schedule\":\"scheduler_config\"")
diffcp_add_fail_test(cli_dit_diffusers_scheduler_karras "use_karras_sigmas = true is not supported" ${DIT} --weights ${DIFFUSERS_DIR}/sched_karras --dry-run)
diffcp_add_fail_test(cli_dit_diffusers_scheduler_field "unknown field 'sigma_schedule' for FlowMatchEulerDiscreteScheduler"
                     ${DIT} --weights ${DIFFUSERS_DIR}/sched_field --dry-run)
# FLUX.1-dev's real shape from its diffusers config.json (the published one: no axes_dims_rope or
# out_channels, so the class's defaults) and a data-less file in diffusers' names.
add_test(NAME cli_dit_diffusers_flux1_real_shape_dry_run COMMAND ${RUN_OK} ${DIT} --weights ${DIFFUSERS_DIR}/flux1-dev --dry-run --json --resolution 1024 --text-tokens 512)
set_tests_properties(cli_dit_diffusers_flux1_real_shape_dry_run PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
  PASS_REGULAR_EXPRESSION "\"double_blocks\":19.*\"heads\":24.*\"hidden\":3072.*\"rope_axes\":\\[16,56,56\\].*\"parameters\":11901408320")
# Weights that fit (issue #35): FLUX.1-dev at P = 2 in bf16, sharded: <= 13 GB of weights per rank.
add_test(NAME cli_dit_flux1_dev_sharded_bf16_dry_run COMMAND ${RUN_OK} ${DIT} --weights ${DIFFUSERS_DIR}/flux1-dev --dry-run --json
         --resolution 1024 --text-tokens 512 --weights-dtype bf16 --shard-weights)
set_tests_properties(cli_dit_flux1_dev_sharded_bf16_dry_run PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
  PASS_REGULAR_EXPRESSION "\"weights_dtype\":\"bf16\",\"shard_weights\":true,\"weights_bytes_per_rank\":12914544896\\.0")
foreach(t IN ITEMS cli_dit_flux1_dev_sharded_bf16_dry_run cli_dit_diffusers_flux1_real_shape_dry_run cli_dit_diffusers_other_class cli_dit_diffusers_unknown_field cli_dit_diffusers_missing_tensors cli_dit_diffusers_no_config cli_dit_diffusers_and_preset cli_dit_diffusers_dry_run cli_dit_diffusers_scheduler_karras cli_dit_diffusers_scheduler_field)
  set_tests_properties(${t} PROPERTIES FIXTURES_REQUIRED diffusers_files)
endforeach()
diffcp_add_fail_test(cli_dit_guidance_without_guidance_in "--guidance 2: this model has no guidance_in" ${DIT} ${DIT_TINY} --guidance 2)
diffcp_add_fail_test(cli_dit_unknown_time_schedule "--schedule 'cosine': unknown schedule, expected linear or flux" ${DIT} ${DIT_TINY} --schedule cosine)
diffcp_add_fail_test(cli_dit_bad_width "image 40x64 pixels, expected positive multiples of 16" ${DIT} ${DIT_TINY} --width 40)
add_test(NAME cli_dit_rect_tokens_not_divisible COMMAND ${RUN_OK} ${DIT} ${DIT_TINY} --width 48 --height 16 --mode vfirst
         --compare flat --json --out "")
set_tests_properties(cli_dit_rect_tokens_not_divisible PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
                     PASS_REGULAR_EXPRESSION "\"image_tokens\":3,.*\"check_passed\":true")
diffcp_add_fail_test(cli_dit_dump_velocity_unwritable "--dump-velocity '/proc/diffcp_nope': cannot create the directory"
                     ${DIT} ${DIT_TINY} --dump-velocity /proc/diffcp_nope)
# ---- `diffcp dit` USP: Ulysses over U ranks x Ring over R = P / U groups (dit/ring_attention.hpp) ----
# U = 2, R = 2 at P = 4, TAPA with L = 2 (Ulysses inside a group, the ring across): bitwise Flat's
# at the same degrees; Ring's K|V per rank per step = layers * 8 (R-1) b n_p H = 2 * 8 * 1 * 6 * 128.
set(DIT4 ${MPIRUN} 4 $<TARGET_FILE:diffcp_cli> dit)
add_test(NAME cli_dit_usp_u2_r2_np4 COMMAND ${RUN_OK} ${DIT4} ${DIT_TINY} --ulysses-degree 2 --ring-degree 2 --mode tapa --group-size 2
                                            --compare flat --json --out "")
set_tests_properties(cli_dit_usp_u2_r2_np4 PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
  PASS_REGULAR_EXPRESSION "\"ulysses_degree\":2,\"ring_degree\":2,\"ring_bytes\":12288\\.0,\"predicted_ring_bytes\":12288\\.0,.*\"psnr\":[0-9][0-9.e+-]*,.*\"reference_run\":\"flat Ulysses, U = 4 over the same 4 ranks\",\"check_passed\":true,")
# --compare flat under USP compares with a genuine reference (issue #41): flat Ulysses over the
# same ranks, a finite PSNR, the latent judged by its tolerance; flat on one rank has none.
add_test(NAME cli_dit_usp_compare_flat_np2 COMMAND ${JSON_CHECK}
         "j['ulysses_degree'] == 1 and j['ring_degree'] == 2" "j['reference_run'] == 'flat Ulysses, U = 2 over the same 2 ranks'"
         "isinstance(j['psnr'], float) and j['psnr'] > 100" "j['max_abs_diff'] > 0" "j['check_passed'] is True"
         "0 < j['max_tol_ratio'] <= 1" "j['mismatches'] == 0" "j['tolerance'] == {'atol': 1e-05, 'rtol': 0.0001, 'atol_scale': 'max(1, max|reference latent|)'}"
         -- ${DIT} ${DIT_TINY} --ulysses-degree 1 --ring-degree 2 --compare flat --json --out "")
set_tests_properties(cli_dit_usp_compare_flat_np2 PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
                     PASS_REGULAR_EXPRESSION "json_check: passed")
diffcp_add_fail_test(cli_dit_flat_np1_compare_refused "--compare flat: this run is flat on one rank, the reference itself; nothing to compare it with"
                     ${MPIRUN} 1 $<TARGET_FILE:diffcp_cli> dit ${DIT_TINY} --compare flat)
# Past the head limit by default: 5 heads on 2 ranks run as U = 1, R = 2.
add_test(NAME cli_dit_usp_default_ring_np2 COMMAND ${RUN_OK} ${DIT} ${DIT_TINY} --heads 5 --json --out "")
set_tests_properties(cli_dit_usp_default_ring_np2 PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
  PASS_REGULAR_EXPRESSION "\"ulysses_degree\":1,\"ring_degree\":2,")
diffcp_add_fail_test(cli_dit_usp_product "--ulysses-degree U = 2 x --ring-degree R = 3 = 6, expected U x R = P = 4 ranks"
                     ${DIT4} ${DIT_TINY} --ulysses-degree 2 --ring-degree 3)
diffcp_add_fail_test(cli_dit_usp_u_not_dividing_p "--ulysses-degree U = 3 does not divide P = 4 ranks" ${DIT4} ${DIT_TINY} --ulysses-degree 3)
diffcp_add_fail_test(cli_dit_usp_u_not_dividing_heads "Ulysses degree U = 4 does not divide the 6 attention heads"
                     ${DIT4} ${DIT_TINY} --heads 6 --ulysses-degree 4)
add_test(NAME cli_dit_usp_tokens COMMAND ${RUN_OK} ${DIT4} --preset tiny --resolution 64 --text-tokens 6 --steps 2
         --ulysses-degree 2 --ring-degree 2 --compare flat --json --out "")
set_tests_properties(cli_dit_usp_tokens PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60
                     PASS_REGULAR_EXPRESSION "\"text_tokens\":6,.*\"check_passed\":true")
diffcp_add_fail_test(cli_dit_usp_zero "--ulysses-degree = 0, expected >= 1" ${DIT} ${DIT_TINY} --ulysses-degree 0)
diffcp_add_fail_test(cli_dit_usp_negative "--ring-degree = -2, expected >= 1" ${DIT} ${DIT_TINY} --ring-degree=-2)
