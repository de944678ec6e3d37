"""Whether torch.compile has reached the model. memfit measures, recomputes and steps the eager
model, so a compiled one is refused by name, before any step: a compiled graph keeps other
tensors for backward than the eager forward memfit measured (its plan would be predicted for
another step), and a block compiled after memfit wrapped it recomputes its eager forward against
the tensors the compiled one saved."""

WHY = ("memfit measures and recomputes the eager model; a compiled graph saves other tensors for backward than the "
       "eager forward it measured and recomputes")


def compiled_part(model):
    """How torch.compile reached the model (a text naming the module), or None."""
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        return "torch.compile(model)"
    for name, module in model.named_modules():
        label = name or "model"
        if getattr(module, "_compiled_call_impl", None) is not None:
            return f"{label}.compile()"
        if getattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable", None) is not None:
            return f"{label}.forward = torch.compile(...)"
    return None


def check_not_compiled(model, name="model"):
    """ValueError naming the compiled part, if torch.compile reached the model."""
    where = compiled_part(model)
    if where is not None:
        raise ValueError(f"{name}: compiled by {where}; expected the eager model ({WHY})")
