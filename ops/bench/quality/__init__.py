"""`kvstash bench quality` and `bench layers`: what each codec does to the model's predictions, and its size."""
