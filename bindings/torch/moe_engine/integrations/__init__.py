"""Framework integrations of moe-engine (see docs/integrations.md):

    moe_engine.integrations.transformers   Hugging Face transformers 5.x: experts_implementation="moe_engine"
    moe_engine.integrations.megatron       an experts module usable in place of Megatron-LM's TEGroupedMLP

Each submodule is imported on demand, so neither framework is needed to import this package."""
