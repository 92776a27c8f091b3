"""Starting runs: the recipes' shared steps, re-launch under an accelerate config, notebook launch."""
