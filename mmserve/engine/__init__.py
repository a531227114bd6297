"""Engine core: sampling parameters, sampler and incremental detokenizer."""
