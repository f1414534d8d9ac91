"""attnchat: the command line that ties the runtime, the model catalog and the desktop together."""
