"""Engine adapters (vLLM, SGLang) and the engine-agnostic GDN layer core. Importing this package imports no engine."""
