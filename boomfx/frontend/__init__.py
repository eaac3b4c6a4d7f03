"""From what the user has (.pt2 file, ExportedProgram, nn.Module, GraphModule) to a Program."""
