"""What the tests share besides fixtures (conftest.py): tiny models, reference computations,
checkpoint writers in published formats, and an in-process served stack. Imported as a package:
`from helpers.tiny_models import tiny_llama`."""
