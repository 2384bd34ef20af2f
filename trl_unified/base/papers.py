"""The papers behind each algorithm, cited once (docstrings and model cards read from here)."""

PAPERS: dict[str, dict[str, str]] = {
    "rloo": {
        "title": "Back to Basics: Revisiting REINFORCE-Style Optimization for Learning from Human Feedback in LLMs",
        "id": "2402.14740",
        "citation": """@inproceedings{ahmadian2024back,
    title        = {{Back to Basics: Revisiting REINFORCE-Style Optimization for Learning from Human Feedback in LLMs}},
    author       = {Arash Ahmadian and Chris Cremer and Matthias Gall{\\'{e}} and Marzieh Fadaee and Julia Kreutzer and Olivier Pietquin and Ahmet {\\"{U}}st{\\"{u}}n and Sara Hooker},
    year         = 2024,
    booktitle    = {Proceedings of the 62nd Annual Meeting of the Association for Computational Linguistics (Volume 1: Long Papers), {ACL} 2024},
    pages        = {12248--12267},
}""",
    },
    "grm": {
        "title": "Generative Verifiers: Reward Modeling as Next-Token Prediction",
        "id": "2408.15240",
        "citation": """@article{zhang2024generative,
    title   = {{Generative Verifiers: Reward Modeling as Next-Token Prediction}},
    author  = {Lunjun Zhang and Arian Hosseini and Hritik Bansal and Mehran Kazemi and Aviral Kumar and Rishabh Agarwal},
    year    = 2024,
    journal = {arXiv preprint arXiv:2408.15240},
}""",
    },
    "grpo": {
        "title": "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
        "id": "2402.03300",
        "citation": """@article{shao2024deepseekmath,
    title        = {{DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models}},
    author       = {Zhihong Shao and Peiyi Wang and Qihao Zhu and Runxin Xu and Junxiao Song and Mingchuan Zhang and Y. K. Li and Y. Wu and Daya Guo},
    year         = 2024,
    eprint       = {arXiv:2402.03300},
}""",
    },
}
