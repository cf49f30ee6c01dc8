"""Prompts of varied lengths for end-to-end checks."""

BASE = [
    "Hello, my name is",
    "The future of AI is",
    "What is the capital of France?",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woodcutter and his three daughters, who",
    "def fibonacci(n):",
    "The three primary colors are",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24,",
    "Translate to French: I love reading books on rainy afternoons.",
    "A",
    "The mitochondria is the powerhouse of the cell. Cells need energy to perform their "
    "functions, and this energy is produced through a process called cellular respiration, "
    "which takes place",
    "Q: Why is the sky blue?\nA:",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "Roses are red, violets are blue,",
    "In 1969, the first humans landed on",
    "List three fruits: apple,",
    "The best way to learn a new programming language is to write many small programs, read "
    "other people's code, and",
    "Water boils at",
    "My favourite recipe for pancakes needs flour, eggs, milk and",
]
