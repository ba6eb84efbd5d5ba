"""Models and data sets registered by name for `shardps worker --model NAME`."""
