# Sourced by the scripts: lets Open MPI run as root (containers, CI), oversubscribe the 2 cores,
# and avoid the CMA single-copy path that containers usually forbid.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none
