"""What the model and the machine are: layer graphs, accelerator and cluster specs, measurements."""
