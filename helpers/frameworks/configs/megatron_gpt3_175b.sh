# GPT-3 175B with Megatron-LM on 128 DGX A100 nodes (1024 GPUs).
# Modelled on Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on
# GPU Clusters Using Megatron-LM", sec. 5.1: GPT-3 175B on 1024 A100s, batch 1536) and on
# the layout of Megatron-LM's 175B example (TP 8 inside a node, PP 16 across nodes);
# written for this course, with the later memory savers switched on.
--num-layers 96 --hidden-size 12288 --num-attention-heads 96
--seq-length 2048 --max-position-embeddings 2048
--tensor-model-parallel-size 8
--pipeline-model-parallel-size 16
--num-layers-per-virtual-pipeline-stage 3
--sequence-parallel
--use-distributed-optimizer
--overlap-grad-reduce
--overlap-param-gather
--recompute-granularity selective
--micro-batch-size 1 --global-batch-size 1536
--fp16 --initial-loss-scale 65536
--ckpt-format torch_dist
--lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine --weight-decay 0.1
--adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.006
--train-iters 500000 --log-interval 100 --save-interval 10000
