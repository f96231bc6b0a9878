"""The EAGLE-3 chain draft (SpecForge / SGLang ``LlamaForCausalLMEagle3``)."""
