"""Tools over the model: describe a config, AOT-compile for a topology, agent evaluation."""
