"""The vocabulary every layer reads: offload group names and layer symbols (`groups`), the model
implementations (`impls`), the frozen model and run specs with the layer-pattern parser and the
presets (`spec`), and whether a run fits the machine's memory (`fits`)."""
