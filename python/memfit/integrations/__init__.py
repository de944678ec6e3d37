"""memfit inside the trainers people already run: the plan put into their own knobs.

    memfit.integrations.transformers   fit(trainer, budget): Hugging Face's Trainer (and TRL's)
    memfit.integrations.lightning      MemfitCallback(budget): a PyTorch Lightning callback

Each plans from one real batch of the user's own data pipeline, loads the whole step's batch,
and runs it as memfit's step does (the plan's micro-batches, precision, recomputed blocks, 8-bit
state), each micro-batch through the trainer's own training step, so the effective batch and the
training stay the same. Each step runs under memfit.budget, and an out-of-memory error in it is
recovered by memfit's C++ policy. The plan and each step's measured peak go to the trainer's log.
Importing this package imports neither library; each module imports its own.
"""
