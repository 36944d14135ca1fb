"""Scale-out launcher: start the teacher-server jobs, the vLLM rollout servers and the trainer on a node list.

A recipe is a trainer config plus a layout file (``*.launch.yaml``) saying which nodes run which job. From the
two and the job's nodes (``--nodes`` or Slurm's ``SLURM_JOB_NODELIST``) the launcher builds every command with the
addresses wired together (:mod:`.plan`), prints them (``--dry-run``) or runs this node's share (:mod:`.run`), and
estimates the memory each device needs (:mod:`.memory`).

    python -m megatron_opd.launch examples/scale/llama-70b_to_llama-8b.launch.yaml --dry-run --nodes a,b,c,d
    python -m megatron_opd.launch examples/scale/llama-70b_to_llama-8b.launch.yaml --memory
"""
