"""A model library's own key/value cache, off while memfit measures and trains the model, as the
library's own gradient checkpointing turns it off in training (Hugging Face's `config.use_cache`):
training reads no cache, a cache object handed to each layer is state that a recomputed layer
would fill again, and the recording of a layer's call would keep it alive after the step."""

NOTE = ("use_cache turned off while memfit trains the model, as Hugging Face's gradient checkpointing does (a "
        "recomputed layer would fill the key/value cache again); memfit.remove(model) turns it back on")


def _configs(model):
    """The configs of the Hugging Face models (a PretrainedConfig: `use_cache`, `to_dict`) among the modules."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(getattr(config, "use_cache", None), bool) and hasattr(config, "to_dict"):
            yield config


class CacheOff:
    """The models' key/value cache off until ``restore()`` puts it back on."""

    def __init__(self, model):
        self.configs = [c for c in {id(c): c for c in _configs(model)}.values() if c.use_cache]
        for config in self.configs:
            config.use_cache = False

    @property
    def applies(self):
        """Whether a cache was on, now off."""
        return bool(self.configs)

    def restore(self):
        for config in self.configs:
            config.use_cache = True
        self.configs = []
