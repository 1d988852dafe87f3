# --- the rollout patch set's helpers (patch/verl_0_9_0/rollout.py) -------------------


def shares_trainer_weights(rollout) -> bool:
    """The rollout generates from this process's own parameters (``oldgpu-hf`` with
    ``weights: trainer`` says so): a weight export would be read by nobody."""
    return getattr(rollout, "shares_trainer_weights", False) is True


async def stamp_shared_weights(worker, global_steps):
    """verl's colocated weight sync without the weights: the rollout's wake-ups in verl's
    order, the step stamped, the allocator left as verl's own path leaves it."""
    from verl.utils.device import set_expandable_segments

    rollout = worker.rollout
    free_cache = worker.config.rollout.free_cache_engine
    if free_cache:
        await rollout.resume(tags=["weights"])
    await rollout.update_weights(
        iter(()), peft_config=None, base_sync_done=True, global_steps=global_steps
    )
    if free_cache:
        await rollout.resume(tags=["kv_cache"])
    worker.base_sync_done = True
    set_expandable_segments(True)
